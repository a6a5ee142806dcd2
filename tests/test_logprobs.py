"""Log-probabilities of the committed tokens: those of transformers' own forward over the answer, whatever the drafter
accepted, sampled or greedy, cut with the answer at a stop string."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_model, tiny_target, tiny_tokenizer
from test_engine import RandomDrafter
from test_lean import _gguf_like, _with_biases

from dartspec import engine, exact
from dartspec.drafters import PromptLookupDrafter
from dartspec.engine import MAX_TOP_LOGPROBS, Generator
from dartspec.errors import DartspecError
from dartspec.lean import LeanTarget
from dartspec.target import Target

PROMPT = [5, 9, 3, 17, 5, 9, 3, 17, 5, 9, 40, 2, 33]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def target(request: pytest.FixtureRequest) -> Target:
    return tiny_target(request.param, seed=3)


def _reference(target: Target, answer: list[int]) -> torch.Tensor:
    """log_softmax of transformers' forward over prompt + answer: row i the distribution of answer token i."""
    ids = torch.tensor([PROMPT + answer])
    with torch.no_grad():
        logits = target.model(ids).logits[0].to(torch.float64)
    return torch.log_softmax(logits, dim=-1)[len(PROMPT) - 1 : len(PROMPT) - 1 + len(answer)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_are_the_targets_whatever_was_accepted(target: Target, temperature: float) -> None:
    plain = Generator(target).generate(PROMPT, max_new_tokens=24, temperature=temperature, seed=7, logprobs=3)
    drafters = [PromptLookupDrafter(), RandomDrafter(seed=2, reference=plain.token_ids, oracle_rate=0.8)]
    want = _reference(target, plain.token_ids)
    for drafter in [None, *drafters]:
        gen = Generator(target, drafter, tree_size=6, max_depth=4)
        out = gen.generate(PROMPT, max_new_tokens=24, temperature=temperature, seed=7, logprobs=3)
        assert out.token_ids == plain.token_ids and out.logprobs is not None
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        got = torch.tensor([lp.logprob for lp in out.logprobs], dtype=torch.float64)
        chosen = want.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        # transformers' whole-sequence forward rounds otherwise than decoding does (Gemma's float32 scalars)
        assert torch.allclose(got, chosen, atol=1e-6)
        values, ids = want.topk(3, dim=-1)
        for lp, i, v in zip(out.logprobs, ids.tolist(), values.tolist(), strict=True):
            assert [t for t, _ in lp.top] == i
            assert [x for _, x in lp.top] == pytest.approx(v, abs=1e-6)
        # and the tree's rows are the one-token decoding's (up to Gemma's float32 rotary tables in a float64 model)
        assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in plain.logprobs], abs=1e-6)
    if temperature == 0:  # greedy: each token is its row's most likely
        assert all(lp.top[0][0] == lp.token_id for lp in plain.logprobs)


def test_logprobs_follow_the_answer_through_streaming_and_a_stop_string(target: Target) -> None:
    gen = Generator(target, PromptLookupDrafter(), tree_size=4)
    full = gen.generate(PROMPT, max_new_tokens=20, logprobs=0)
    assert full.logprobs is not None and all(lp.top == () for lp in full.logprobs)
    events = list(gen.stream(PROMPT, max_new_tokens=20, logprobs=0))
    streamed = [lp for ev in events for lp in ev.logprobs]
    assert streamed == full.logprobs and [e for ev in events for e in ev.token_ids] == full.token_ids
    # A stop string cuts the answer; the log-probabilities end with it
    stop = target.decode(full.token_ids[3:5])
    cut = gen.generate(PROMPT, max_new_tokens=20, logprobs=1, stop=[stop])
    assert cut.logprobs is not None and len(cut.logprobs) == len(cut.token_ids) < len(full.token_ids)
    assert [lp.logprob for lp in cut.logprobs] == [lp.logprob for lp in full.logprobs[: len(cut.token_ids)]]
    # Not asked for: none taken
    assert gen.generate(PROMPT, max_new_tokens=4).logprobs is None
    assert all(ev.logprobs is None for ev in gen.stream(PROMPT, max_new_tokens=4))
    assert "logprobs" not in gen.generate(PROMPT, max_new_tokens=4).as_dict()
    assert len(full.as_dict()["logprobs"]) == len(full.token_ids)


@pytest.mark.parametrize("bad", [-1, MAX_TOP_LOGPROBS + 1, 1.5, True])
def test_a_bad_logprobs_count_is_refused(bad: object) -> None:
    target = tiny_target("llama", seed=3, layers=3)
    with pytest.raises(DartspecError, match="logprobs must be an integer"):
        Generator(target).generate(PROMPT, max_new_tokens=2, logprobs=bad)


def test_the_vocabulary_is_what_the_alternatives_range_over(target: Target) -> None:
    out = Generator(target).generate(PROMPT, max_new_tokens=3, logprobs=MAX_TOP_LOGPROBS)
    assert out.logprobs is not None
    for lp in out.logprobs:
        ids = [t for t, _ in lp.top]
        assert len(ids) == MAX_TOP_LOGPROBS == len(set(ids)) and all(0 <= t < VOCAB for t in ids)
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and lp.logprob <= values[0]


@pytest.mark.skipif(not exact.available(), reason="dartspec's C kernels do not build here")
def test_on_the_exact_cpu_format_a_trees_logprobs_are_one_token_decodings_bit_for_bit() -> None:
    """The CPU default's format computes each row alone: the log-probabilities do not depend on what was drafted."""
    model = _with_biases(_gguf_like(tiny_model("qwen2", seed=5).float()), 5)
    target = LeanTarget(model, tiny_tokenizer(), quant="exact-a16")
    plain = Generator(target).generate(PROMPT, max_new_tokens=24, logprobs=2)
    drafter = RandomDrafter(seed=4, reference=plain.token_ids, oracle_rate=0.8)
    spec = Generator(target, drafter, tree_size=6, max_depth=4).generate(PROMPT, max_new_tokens=24, logprobs=2)
    assert spec.token_ids == plain.token_ids and spec.logprobs == plain.logprobs


def test_prompt_logprobs_are_transformers_forward_over_the_prompt(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prompt_logprobs``: each prompt token after the first, its log-probability, rank and alternatives under
    transformers' own forward over the prompt, in scoring chunks; the answer is the one a plain request gets."""
    monkeypatch.setattr(engine, "SCORE_CHUNK", 128)  # the tiny models' context holds 512 tokens
    long_prompt = PROMPT * 30  # 390 tokens: four chunks
    with torch.no_grad():
        logits = target.model(torch.tensor([long_prompt])).logits[0].to(torch.float64)
    want = torch.log_softmax(logits, dim=-1)[:-1]
    following = torch.tensor(long_prompt[1:])
    gen = Generator(target, PromptLookupDrafter(), tree_size=4)
    plain = gen.generate(long_prompt, max_new_tokens=8, logprobs=1)
    out = gen.generate(long_prompt, max_new_tokens=8, logprobs=1, prompt_logprobs=3)
    assert out.token_ids == plain.token_ids and plain.prompt_logprobs is None
    assert out.logprobs is not None and plain.logprobs is not None  # chunks other than a prefill's: other rounding
    assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in plain.logprobs], abs=1e-6)
    scored = out.prompt_logprobs
    assert scored is not None and [lp.token_id for lp in scored] == long_prompt[1:]
    chosen = want.gather(1, following[:, None])[:, 0]
    assert torch.allclose(torch.tensor([lp.logprob for lp in scored], dtype=torch.float64), chosen, atol=1e-6)
    ranks = (want > chosen[:, None] + 1e-9).sum(-1) + 1  # a margin: the two forwards round differently
    assert [lp.rank for lp in scored] == ranks.tolist() and {lp.rank for lp in scored} != {1}
    values, ids = want.topk(3, dim=-1)
    assert [[t for t, _ in lp.top] for lp in scored] == ids.tolist()
    assert [v for lp in scored for _, v in lp.top] == pytest.approx(values.flatten().tolist(), abs=1e-6)
    assert len(out.as_dict()["prompt_logprobs"]) == len(long_prompt) - 1


def test_a_prompt_scored_alone_generates_nothing() -> None:
    target = tiny_target("llama", seed=3, layers=3)
    gen = Generator(target)
    out = gen.generate(PROMPT, max_new_tokens=0, prompt_logprobs=0)
    assert gen.generate(PROMPT, max_new_tokens=0, logprobs=2, prompt_logprobs=0).logprobs == []
    assert (out.token_ids, out.text, out.finish_reason, out.logprobs) == ([], "", "length", None)
    assert out.prompt_logprobs == gen.generate(PROMPT, max_new_tokens=1, prompt_logprobs=0).prompt_logprobs
    assert [lp.top for lp in out.prompt_logprobs] == [()] * (len(PROMPT) - 1)
    assert gen.generate(PROMPT[:1], max_new_tokens=0, prompt_logprobs=2).prompt_logprobs == []
    with pytest.raises(DartspecError, match="0 only to score the prompt"):
        gen.generate(PROMPT, max_new_tokens=0)
    with pytest.raises(DartspecError, match="prompt_logprobs must be an integer"):
        gen.generate(PROMPT, max_new_tokens=2, prompt_logprobs=-1)


@pytest.mark.skipif(not exact.available(), reason="dartspec's C kernels do not build here")
def test_on_the_exact_cpu_format_a_scored_prompt_changes_nothing_and_skips_the_prefix_cache() -> None:
    """Scoring the prompt runs a plain prefill's forwards: the answer and its log-probabilities are bit for bit a
    plain request's; with a prefix cache holding the prompt, the prompt is still scored (nothing shared has logits)."""
    model = _with_biases(_gguf_like(tiny_model("qwen2", seed=5).float()), 5)
    target = LeanTarget(model, tiny_tokenizer(), quant="exact-a16")
    prompt = PROMPT * 8
    plain = Generator(target).generate(prompt, max_new_tokens=12, logprobs=2)
    first = Generator(target).generate(prompt, max_new_tokens=12, logprobs=2, prompt_logprobs=1)
    assert (first.token_ids, first.logprobs) == (plain.token_ids, plain.logprobs)
    target.enable_prefix_cache(1 << 24)
    Generator(target).generate(prompt, max_new_tokens=2)  # the prompt's blocks now cached
    again = Generator(target).generate(prompt, max_new_tokens=12, logprobs=2, prompt_logprobs=1)
    assert (again.token_ids, again.logprobs) == (plain.token_ids, plain.logprobs)
    assert again.prompt_logprobs == first.prompt_logprobs and len(first.prompt_logprobs) == len(prompt) - 1
