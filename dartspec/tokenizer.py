"""A model's tokenizer without transformers: the Rust tokenizer that transformers drives, and its chat template.

Loading a tokenizer through transformers costs a default CPU ``dartspec generate`` more than its model does once the
lean runtime's snapshot (:mod:`dartspec.lean_weights`) makes the model fast to load: importing transformers ~1 s on 2
cores, then its tokenizer class ~0.5 s (SmolLM2) to ~4.7 s (Gemma 3, which the Rust library alone reads in ~1.9 s).
What dartspec asks of a tokenizer is small (encode with or without special tokens, decode, the vocabulary, the EOS
id, the chat template rendered to text), and transformers itself does most of it in the ``tokenizers`` library.

So :func:`describe` records, from a tokenizer transformers loaded, what those calls read: the Rust tokenizer as
transformers set it up (serialized: transformers builds some, Qwen2's among them, otherwise than the folder's
``tokenizer.json``), the chat template and the special tokens it is rendered with, and checks that a
:class:`LightTokenizer` built from the record answers a set of probes exactly as transformers does (encodings with
and without special tokens, decodings with and without them, the vocabulary, chat renderings); any difference, or a
behaviour it does not reproduce (clean-up of spaces on decode, split special tokens), means no record. Anything else
asked of a :class:`LightTokenizer`, and chat calls beyond plain role / content messages rendered to text, go to
transformers' tokenizer of the folder, loaded on first use.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dartspec import atomic

RECORD_VERSION = 1

# Text that exercises what differs between tokenizers: spaces and their runs, newlines, tabs, CR, accents, CJK, emoji,
# digits, code, and the special tokens written as text (added per tokenizer in describe()).
_PROBES = (
    "",
    "Hello, world!",
    " leading space and trailing  ",
    "line one\nline two\n\n\nthree\r\nCRLF\ttab",
    "unicode: héllo wörld, naïve café — 你好，世界 🙂🚀 ∑x² ≠ ∞",
    "def f(x):\n    return x ** 2  # a comment\n\nprint(f(3))",
    "Numbers 1234567890, 3.14159, 1e-9 and 10,000.",
    "a     b      c\u00a0d\u200be",
    "   ",
    "I'm sure they'll say \"it's fine\" -- won't they?",
    "spaces before marks , . ? ! and 's n't 'm 've 're ' (what a decode's clean-up would remove)",
)
_CONVERSATIONS = (
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a color. 🙂"}],
    [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Leaves fall.\nQuiet now."},
        {"role": "user", "content": "  Another, with trailing space  "},
    ],
)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which some chat templates use to mark the assistant's text for
    transformers' masks: rendered as its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace()`` without underscore-prefixed names (templates are untrusted; transformers' rule too)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's Namespace signature (a key may be "self")
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Not jinja's own filter, which escapes HTML characters: chat templates write JSON into prompts as it is.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    """A chat template in the environment chat templates are written for (the one transformers renders them in)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


class LightTokenizer:
    """The calls dartspec makes of a transformers tokenizer, answered by ``tokenizers`` and jinja2 (see the module's
    docstring); any other attribute is the full tokenizer's, loaded by ``load_full`` on first use."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None,
        special_tokens: dict[str, Any],
        eos_token_id: int | None,
        all_special_ids: Sequence[int],
        clean_up_tokenization_spaces: bool,
        load_full: Callable[[], Any],
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens_map = dict(special_tokens)
        self.eos_token_id = eos_token_id
        self.all_special_ids = list(all_special_ids)
        # What decode does with spaces before punctuation: describe() records only tokenizers whose decode leaves
        # the text as the Rust decoder made it; the flag stays what transformers reads (the engine's streaming asks).
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._load_full = load_full
        self._full: Any = None
        self._template: jinja2.Template | None = None

    @classmethod
    def from_record(cls, record: dict[str, Any], folder: Path, load_full: Callable[[], Any]) -> LightTokenizer:
        """The tokenizer :func:`describe` recorded (``folder``: the model's, where a record names its file)."""
        if record.get("version") != RECORD_VERSION:
            raise ValueError(f"tokenizer record version {record.get('version')}, not {RECORD_VERSION}")
        path = Path(record["file"]) if Path(record["file"]).is_absolute() else folder / record["file"]
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises a bare Exception for a missing or damaged file
            raise ValueError(f"cannot read the tokenizer {path}: {exc}") from exc
        return cls(backend, load_full=load_full, **_settings(record))

    # --- what dartspec calls ------------------------------------------------------------------

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, Any]:
        if isinstance(text, str):
            return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}
        encodings = self.backend.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(
        self, conversation: Sequence[Any], add_generation_prompt: bool = False, tokenize: bool = True, **kwargs: Any
    ) -> Any:
        """Rendered text of one conversation of role / content strings (``tokenize=False``); any other call is the
        full tokenizer's."""
        messages = _plain_messages(conversation)
        if tokenize or kwargs or messages is None or not self.chat_template:
            return self.full.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs
            )
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if self._template is None:
            self._template = compile_template(self.chat_template)
        return self._template.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )  # fmt: skip

    # --- everything else ----------------------------------------------------------------------

    @property
    def full(self) -> Any:
        """transformers' tokenizer of the same folder (loaded on first use)."""
        if self._full is None:
            self._full = self._load_full()
        return self._full

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never for private names (copy and pickle look some up before __init__ runs)
            raise AttributeError(name)
        return getattr(self.full, name)


def _settings(record: dict[str, Any]) -> dict[str, Any]:
    """A record's keyword arguments of :class:`LightTokenizer` (all but the Rust tokenizer)."""
    keys = ("chat_template", "eos_token_id", "all_special_ids", "clean_up_tokenization_spaces")
    return {"special_tokens": record["special_tokens"], **{k: record[k] for k in keys}}


def _plain_messages(conversation: Any) -> list[dict[str, str]] | None:
    """The messages as the template sees them where each is a dict of a str role and str content (keys with None
    dropped, as transformers does); None for anything else (batches, tool calls, content parts, reasoning fields)."""
    if not isinstance(conversation, (list, tuple)):
        return None
    out = []
    for message in conversation:
        if not isinstance(message, dict):
            return None
        kept = {k: v for k, v in message.items() if v is not None}
        if set(kept) - {"role", "content"} or not all(type(v) is str for v in kept.values()):
            return None
        out.append(kept)
    return out


# --- recording ----------------------------------------------------------------------------------


def describe(tokenizer: Any, folder: Path, store: Path) -> dict[str, Any] | None:
    """A record from which :meth:`LightTokenizer.from_record` builds a tokenizer answering as ``tokenizer`` (a
    transformers tokenizer loaded from ``folder``) does, or None where it would not (see the module's docstring).
    The Rust tokenizer is referred to in ``folder`` where transformers uses the folder's ``tokenizer.json`` as it is,
    else written under ``store`` (named by its content)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer) or backend.truncation or backend.padding:
        return None
    if getattr(tokenizer, "split_special_tokens", False):
        return None
    cleans = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    if cleans and (type(backend.model).__name__ != "BPE" or forced):  # transformers skips it for BPE models
        return None
    try:
        template = tokenizer.get_chat_template() if getattr(tokenizer, "chat_template", None) else None
    except ValueError:
        template = None
    if template is not None and not isinstance(template, str):
        return None
    special = dict(getattr(tokenizer, "special_tokens_map", {}))
    if not all(
        isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)) for v in special.values()
    ):
        return None  # the record is JSON: tokens as text
    eos = getattr(tokenizer, "eos_token_id", None)
    serialized = backend.to_str()
    own = folder / "tokenizer.json"
    same = tokenizers.Tokenizer.from_file(str(own)) if own.is_file() else None
    if same is not None and same.to_str() == serialized:
        file = "tokenizer.json"
    else:
        path = store / f"tokenizer-{hashlib.sha256(serialized.encode()).hexdigest()[:16]}.json"
        if not path.is_file():
            atomic.write_text(path, serialized)
        file, same = str(path), tokenizers.Tokenizer.from_str(serialized)
    record = {
        "version": RECORD_VERSION,
        "file": file,
        "chat_template": template,
        "special_tokens": special,
        "eos_token_id": eos if isinstance(eos, int) else None,
        "all_special_ids": [int(i) for i in getattr(tokenizer, "all_special_ids", [])],
        "clean_up_tokenization_spaces": cleans,
    }
    # Checked as it will be read: the Rust tokenizer from the recorded file's text, the rest from the record.
    light = LightTokenizer(same, load_full=lambda: tokenizer, **_settings(record))
    return record if differences(light, tokenizer) == [] else None


def differences(light: LightTokenizer, tokenizer: Any) -> list[str]:
    """Where ``light`` answers the probes otherwise than ``tokenizer`` does (empty: nowhere)."""
    found = []
    texts = list(_PROBES)
    specials = [str(t) for t in _special_strings(light.special_tokens_map)]
    texts += ["".join(specials), f"{' x '.join(specials)} end", *(f"Say {t}, then stop." for t in specials)]
    for add in (True, False):
        if light(texts, add_special_tokens=add)["input_ids"] != tokenizer(texts, add_special_tokens=add)["input_ids"]:
            found.append(f"batch encoding (add_special_tokens={add})")
        for text in texts:
            ours, theirs = light(text, add_special_tokens=add)["input_ids"], tokenizer(text, add_special_tokens=add)
            if ours != theirs["input_ids"]:
                found.append(f"encoding of {text!r} (add_special_tokens={add})")
    size = len(tokenizer)
    id_runs = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
    id_runs += [list(range(i, min(size, i + 40))) for i in range(0, size, max(1, size // 25))]
    id_runs += [list(light.all_special_ids), list(range(max(0, size - 64), size))]
    for ids in id_runs:
        for skip in (True, False):
            if light.decode(ids, skip_special_tokens=skip) != tokenizer.decode(ids, skip_special_tokens=skip):
                found.append(f"decoding of {ids[:8]}... (skip_special_tokens={skip})")
    if light.get_vocab() != tokenizer.get_vocab() or len(light) != size:
        found.append("vocabulary")
    if light.eos_token_id != tokenizer.eos_token_id or light.all_special_ids != list(tokenizer.all_special_ids):
        found.append("special token ids")
    if light.chat_template:
        for conversation in _CONVERSATIONS:
            for prompt in (True, False):
                if _render(light, conversation, prompt) != _render(tokenizer, conversation, prompt):
                    found.append(f"chat rendering of {len(conversation)} messages (generation prompt {prompt})")
    return found


def _special_strings(special: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for value in special.values():
        out.extend(value if isinstance(value, list) else [value])
    return [str(v) for v in out if v]


def _render(tokenizer: Any, conversation: list[dict[str, str]], prompt: bool) -> str:
    """The rendered text, or the error's type and message (a template that refuses a conversation must refuse it
    alike)."""
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=prompt, tokenize=False)
    except Exception as exc:  # any refusal, compared by what it says
        return f"<{type(exc).__name__}: {exc}>"
