"""The tokenizer read without transformers (:mod:`dartspec.tokenizer`) answers as transformers' own tokenizer of the
same folder does, and where it would not, there is no record of it."""

from __future__ import annotations

import pickle
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dartspec import tokenizer as light_module
from dartspec.tokenizer import LightTokenizer, compile_template, describe, differences

# ChatML with a default system turn, as SmolLM2's and Qwen's templates write it, plus what templates use: a namespace,
# loop variables, loop controls, raise_exception, tojson, a special token and transformers' generation tag.
CHAT_TEMPLATE = """{{ bos_token }}{%- set ns = namespace(system=false) -%}
{%- for message in messages -%}
{%- if message['role'] not in ['system', 'user', 'assistant'] -%}
{{ raise_exception('unknown role ' ~ message['role']) }}
{%- endif -%}
{%- if message['role'] == 'system' %}{% set ns.system = true %}{% endif -%}
{%- endfor -%}
{%- if not ns.system %}<|im_start|>system
You are helpful. {{ {'n': messages | length} | tojson }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'assistant' %}<|im_start|>assistant
{% generation %}{{ message['content'] | trim }}{% endgeneration %}<|im_end|>
{% else %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- if loop.index > 50 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
   {% if messages | length > 1 %}{% endif %}"""

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "def reverse(s):\n    return s[::-1]\n",
    "The quick brown fox jumps over the lazy dog. Héllo wörld, 你好 🙂",
    "Numbers 1234567890 and spaces   between\ttabs\r\n",
] * 20


def _byte_level_bpe() -> Tokenizer:
    """A small byte-level BPE with a BOS post-processor (what Llama-family files have), trained in milliseconds."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bpe-tokenizer")
    PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_bpe(),
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="</s>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf(folder: Path):
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def light(hf, folder: Path, tmp_path_factory: pytest.TempPathFactory) -> LightTokenizer:
    record = describe(hf, folder, tmp_path_factory.mktemp("store"))
    assert record is not None and record["file"] == "tokenizer.json"  # transformers uses the folder's file as it is
    return LightTokenizer.from_record(record, folder, load_full=lambda: pytest.fail("transformers' tokenizer loaded"))


texts = st.text(st.characters(codec="utf-8"), max_size=60) | st.lists(
    st.sampled_from([*SPECIALS, " ", "\n", "def", "é", "🙂", "x", "  "]), max_size=12
).map("".join)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": texts}),
    min_size=1,
    max_size=4,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, batch=st.lists(texts, min_size=1, max_size=4), add=st.booleans(), skip=st.booleans())
def test_encoding_and_decoding_equal_transformers(hf, light: LightTokenizer, text: str, batch, add, skip) -> None:
    ids = light(text, add_special_tokens=add)["input_ids"]
    assert ids == hf(text, add_special_tokens=add)["input_ids"]
    assert light(batch, add_special_tokens=add)["input_ids"] == hf(batch, add_special_tokens=add)["input_ids"]
    assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversation=messages, prompt=st.booleans())
def test_chat_rendering_equals_transformers(hf, light: LightTokenizer, conversation, prompt: bool) -> None:
    ours = light.apply_chat_template(conversation, add_generation_prompt=prompt, tokenize=False)
    assert ours == hf.apply_chat_template(conversation, add_generation_prompt=prompt, tokenize=False)


def test_the_rest_of_the_tokenizer_is_transformers_loaded_on_first_use(hf, folder: Path) -> None:
    record = describe(hf, folder, folder / "store")
    loads = []

    def load():
        loads.append(1)
        return AutoTokenizer.from_pretrained(folder)

    tok = LightTokenizer.from_record(record, folder, load_full=load)
    conversation = [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role bot"):  # the template's own refusal
        tok.apply_chat_template(conversation, tokenize=False)
    assert tok.get_vocab() == hf.get_vocab() and len(tok) == len(hf) and tok.eos_token_id == hf.eos_token_id
    assert tok.all_special_ids == hf.all_special_ids and tok.chat_template == hf.chat_template
    unset = [{"role": "user", "content": "hi", "name": None}]  # a field left None is dropped, as transformers does
    assert tok.apply_chat_template(unset, tokenize=False) == hf.apply_chat_template(unset, tokenize=False)
    assert loads == []
    # Calls it does not answer itself: tokenized chats, batches, other message fields, other attributes.
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == hf.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert loads == [1]
    batch = [chat, [{"role": "user", "content": "yo"}]]
    assert tok.apply_chat_template(batch, tokenize=False) == hf.apply_chat_template(batch, tokenize=False)
    named = [{"role": "user", "content": "hi", "name": "ann"}]
    assert tok.apply_chat_template(named, tokenize=False) == hf.apply_chat_template(named, tokenize=False)
    assert tok.decode(5) == hf.decode(5)  # one id, as transformers takes it
    assert tok.convert_ids_to_tokens([5, 6]) == hf.convert_ids_to_tokens([5, 6])
    assert tok.pad_token_id == hf.pad_token_id
    assert loads == [1]
    with pytest.raises(AttributeError):
        tok._private  # noqa: B018 (never forwarded)
    again = pickle.loads(pickle.dumps(LightTokenizer.from_record(record, folder, load_full=_load_nothing)))
    assert again("hi there")["input_ids"] == hf("hi there")["input_ids"]


def _load_nothing():
    raise AssertionError("not loaded")


def test_a_backend_transformers_set_up_otherwise_is_stored_and_read_back(hf, folder: Path, tmp_path: Path) -> None:
    changed = AutoTokenizer.from_pretrained(folder)
    changed.backend_tokenizer.normalizer = normalizers.Lowercase()  # what a tokenizer class may do while loading
    record = describe(changed, folder, tmp_path)
    assert record is not None and Path(record["file"]).parent == tmp_path
    tok = LightTokenizer.from_record(record, folder, load_full=_load_nothing)
    assert tok("Hello World")["input_ids"] == changed("Hello World")["input_ids"] != hf("Hello World")["input_ids"]
    Path(record["file"]).write_text("{")
    with pytest.raises(ValueError, match="cannot read the tokenizer"):
        LightTokenizer.from_record(record, folder, load_full=_load_nothing)


def test_no_record_where_any_answer_would_differ(
    hf, folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as m:  # a rendering environment that differs from the templates' own
        m.setattr(
            light_module, "compile_template", lambda source: jinja2.Environment(trim_blocks=True).from_string(source)
        )
        assert describe(hf, folder, tmp_path) is None
    with monkeypatch.context() as m:  # special tokens read wrongly: the chat renders otherwise
        m.setattr(light_module, "_settings", lambda r: {**_settings_of(r), "special_tokens": {}})
        assert describe(hf, folder, tmp_path) is None

    class TokenObjects:  # special tokens that are not text (the record is JSON)
        special_tokens_map = {"bos_token": object()}  # noqa: RUF012

        def __getattr__(self, name: str):
            return getattr(hf, name)

    assert describe(TokenObjects(), folder, tmp_path) is None
    forced = AutoTokenizer.from_pretrained(
        folder,
        clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True,
    )
    assert forced.decode(forced(" a , b")["input_ids"], skip_special_tokens=True) == " a, b"  # it cleans up
    assert describe(forced, folder, tmp_path) is None
    splitting = AutoTokenizer.from_pretrained(folder, split_special_tokens=True)
    assert describe(splitting, folder, tmp_path) is None
    # A decode that cleans up spaces (transformers does so for models other than BPE) is not reproduced.
    word = Tokenizer(models.WordLevel({"a": 0, "b": 1, ".": 2, "[UNK]": 3}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    word.decoder = decoders.WordPiece()
    cleaning = PreTrainedTokenizerFast(tokenizer_object=word, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    cleaning.save_pretrained(tmp_path / "word")
    assert cleaning.decode([0, 2]) == "a."  # what it does
    assert describe(cleaning, tmp_path / "word", tmp_path) is None
    # differences() itself finds a wrong vocabulary and a wrong EOS id
    ok = LightTokenizer.from_record(describe(hf, folder, tmp_path), folder, load_full=_load_nothing)
    ok.eos_token_id = 0
    assert differences(ok, hf) == ["special token ids"]


_settings_of = light_module._settings


def test_templates_run_sandboxed() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_template("{% set ns = namespace() %}{% set ns._x = 1 %}").render()
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_template("{{ ''.__class__.__mro__[1].__subclasses__() }}").render()
    assert compile_template("{{ x | tojson }}").render(x={"a": "<é>"}) == '{"a": "<é>"}'  # no HTML escaping
