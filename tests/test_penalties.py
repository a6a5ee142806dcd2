"""Penalties and logit bias: each tree row is adjusted as plain decoding would adjust it after that row's path, greedy
output equals transformers' ``generate`` with the same repetition penalty and bias, and with any drafter the
committed tokens (greedy and seeded sampling) equal a naive loop's that applies the penalties itself."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from conftest import VOCAB, tiny_target
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import RandomDrafter
from test_verify import _sampled_tree

from dartspec.drafters import PromptLookupDrafter
from dartspec.engine import Generator
from dartspec.errors import DartspecError
from dartspec.penalties import PenaltyState
from dartspec.sampling import Penalties, SamplingParams, bad_word_tokens
from dartspec.target import Target
from dartspec.tree import Tree
from dartspec.verify import Verifier, sample, warp

PROMPT = [5, 9, 3, 17, 5, 9, 3, 17, 5, 9, 40, 2, 33, 5, 9]


def naive(logits: torch.Tensor, penalties: Penalties, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """One row adjusted from its whole history, written out as the definitions say (float64)."""
    x = logits.to(torch.float64).clone()
    for token, bias in penalties.logit_bias:
        x[token] += bias
    for token in set(prompt) | set(answer):
        x[token] = x[token] * penalties.repetition if x[token] < 0 else x[token] / penalties.repetition
    for token, count in Counter(answer).items():
        x[token] -= penalties.frequency * count + penalties.presence
    if penalties.allowed is not None:
        x[[t for t in range(len(x)) if t not in penalties.allowed]] = float("-inf")
    for word in penalties.bad_words:  # its last token, where the answer ends with the rest
        if len(word) == 1 or answer[len(answer) - len(word) + 1 :] == list(word[:-1]):
            x[word[-1]] = float("-inf")
    return x


def random_tree(rng: np.random.Generator, size: int, alphabet: int) -> Tree:
    """A tree of ``size`` nodes with tokens from a small alphabet (paths repeat tokens) and distinct siblings."""
    tokens, parents, children = [int(rng.integers(alphabet))], [-1], [set()]
    while len(tokens) < size:
        parent = int(rng.integers(len(tokens)))
        token = int(rng.integers(alphabet))
        if token in children[parent]:
            continue
        children[parent].add(token)
        tokens.append(token)
        parents.append(parent)
        children.append(set())
    return Tree(np.array(tokens), np.array(parents))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    size=st.integers(1, 12),
    repetition=st.sampled_from([1.0, 0.7, 1.3]),
    presence=st.sampled_from([0.0, -0.5, 1.5]),
    frequency=st.sampled_from([0.0, 0.4, -2.0]),
    bias=st.booleans(),
    bad=st.booleans(),
)
def test_each_row_is_adjusted_with_its_own_path(
    seed: int, size: int, repetition: float, presence: float, frequency: float, bias: bool, bad: bool
) -> None:
    rng = np.random.default_rng(seed)
    bad_words = ((3,), (4, 5), (5, 4), (1, 2, 0), (2, 2, 2, 1)) if bad else ()  # the paths' alphabet: 0-5
    penalties = Penalties(repetition, presence, frequency, {3: 2.5, 7: -100} if bias else (), bad_words=bad_words)
    prompt = rng.integers(0, 12, size=5).tolist()
    answer = rng.integers(0, 12, size=int(rng.integers(0, 6))).tolist()
    state = PenaltyState(penalties, prompt)
    state.commit(answer[:2])  # before the vectors exist ...
    state(torch.zeros(1, 16))
    state.commit(answer[2:])  # ... and after
    tree = random_tree(rng, size, alphabet=6)
    logits = torch.randn(size, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 3
    got = state(logits, tree)
    for i in range(size):
        path = [int(tree.tokens[j]) for j in tree.path_to(i)[1:]]  # the root is committed already
        want = naive(logits[i], penalties, prompt, answer + path)
        assert torch.allclose(got[i], want, atol=1e-12, equal_nan=False), (i, path)
        assert torch.equal(got[i].isinf(), want.isinf()), (i, path)
    assert torch.equal(state(logits[:1]), got[:1])  # no tree: the committed history alone


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def target(request: pytest.FixtureRequest) -> Target:
    return tiny_target(request.param, seed=3)


def drafters(reference: list[int]) -> list:
    return [None, PromptLookupDrafter(min_ngram=1), RandomDrafter(seed=2, reference=reference, oracle_rate=0.8)]


@pytest.mark.parametrize(
    "settings_",
    [
        dict(repetition_penalty=3.0),
        dict(logit_bias={9: -100.0, 33: -100.0, 45: 2.0}),
        dict(repetition_penalty=0.8, logit_bias={9: -100.0, 33: -100.0, 62: 4.0}),  # the bias first, then the penalty
    ],
)
def test_greedy_equals_transformers_generate(target: Target, settings_: dict) -> None:
    hf = {"repetition_penalty": settings_.get("repetition_penalty", 1.0)}
    if "logit_bias" in settings_:
        hf["sequence_bias"] = {(t,): b for t, b in settings_["logit_bias"].items()}
    ref = target.model.generate(
        torch.tensor([PROMPT]),
        attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        do_sample=False,
        max_new_tokens=24,
        eos_token_id=1,
        pad_token_id=0,
        **hf,
    )[0, len(PROMPT) :].tolist()
    plain = Generator(target).generate(PROMPT, max_new_tokens=24)
    assert plain.token_ids != ref  # the settings change this answer (else the test could not fail)
    for drafter in drafters(ref):
        got = Generator(target, drafter, tree_size=6, max_depth=4).generate(PROMPT, max_new_tokens=24, **settings_)
        assert got.token_ids == ref, drafter


def naive_decode(
    target: Target, penalties: Penalties, n: int, temperature: float, seed: int
) -> tuple[list[int], list[float]]:
    """Plain decoding written out: transformers' forward over the whole sequence each step, the penalties applied by
    :func:`naive`, the argmax or an inverse-CDF draw from the verifier's generator seeded as it seeds it; with each
    token's log-probability under the unpenalised forward."""
    rng = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=temperature, seed=seed)
    answer: list[int] = []
    logprobs: list[float] = []
    while len(answer) < n and (not answer or answer[-1] != 1):
        with torch.no_grad():
            logits = target.model(torch.tensor([PROMPT + answer])).logits[0, -1]
        x = naive(logits, penalties, PROMPT, answer)
        if temperature == 0:
            answer.append(int(x.argmax()))
        else:
            answer.append(sample(warp(x, params), float(torch.rand((), generator=rng, dtype=torch.float64))))
        logprobs.append(float(torch.log_softmax(logits.to(torch.float64), -1)[answer[-1]]))
    return answer, logprobs


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_any_drafter_commits_what_a_naive_penalised_loop_does(target: Target, temperature: float) -> None:
    penalties = Penalties(repetition=1.2, presence=0.6, frequency=0.9, logit_bias={40: 1.5})
    ref, ref_logprobs = naive_decode(target, penalties, 24, temperature, seed=11)
    kwargs = dict(
        repetition_penalty=1.2,
        presence_penalty=0.6,
        frequency_penalty=0.9,
        logit_bias={40: 1.5},
        temperature=temperature,
    )
    for drafter in drafters(ref):
        gen = Generator(target, drafter, tree_size=6, max_depth=4)
        out = gen.generate(PROMPT, max_new_tokens=24, seed=11, logprobs=0, **kwargs)
        assert out.token_ids == ref, drafter
        if isinstance(drafter, RandomDrafter):  # paths of several tokens were adjusted and accepted
            assert len(out.stats.depth_accepted) > 1 and out.stats.depth_accepted[1] > 0
        # log-probabilities stay the target's own, before the penalties (up to Gemma's float32 rotary tables)
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(ref_logprobs, abs=1e-6)
    # the frequency penalty alone: the answer repeats its tokens less than without it
    free = Generator(target).generate(PROMPT, max_new_tokens=24, temperature=temperature, seed=11).token_ids
    assert max(Counter(ref).values()) < max(Counter(free).values())


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_allowed_token_ids_commit_what_a_naive_masked_loop_does(target: Target, temperature: float) -> None:
    """vLLM's allowed_token_ids: only those tokens, with any drafter, greedy and sampled (EOS only if listed); with a
    repetition penalty beside it; refused where nothing could be chosen before min_tokens or with a grammar."""
    allowed = [3, 5, 9, 17, 33, 40, 62]
    penalties = Penalties(repetition=1.3, allowed=allowed)
    ref, _ = naive_decode(target, penalties, 20, temperature, seed=5)
    assert set(ref) <= set(allowed) and len(ref) == 20
    for drafter in drafters(ref):
        gen = Generator(target, drafter, tree_size=6, max_depth=4)
        out = gen.generate(
            PROMPT,
            max_new_tokens=20,
            seed=5,
            temperature=temperature,
            repetition_penalty=1.3,
            allowed_token_ids=allowed,
        )
        assert out.token_ids == ref, drafter
    gen = Generator(target)
    for kwargs, why in [
        (dict(allowed_token_ids=[]), "non-empty list of token ids"),
        (dict(allowed_token_ids=[VOCAB]), f"names token {VOCAB}, outside"),
        (dict(allowed_token_ids=[1], min_tokens=2), "must allow a token that does not end the answer"),
        (dict(allowed_token_ids=[3], response_format="json_object"), "cannot be combined with a structured answer"),
    ]:
        with pytest.raises(DartspecError, match=why):
            gen.generate(PROMPT, max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bad_words_commit_what_a_naive_loop_banning_them_does(target: Target, temperature: float) -> None:
    """vLLM's bad_words (as token sequences: a word's last token impossible where the answer ends with the rest of
    it): with any drafter, greedy and sampled, the answer a naive loop gives, and the banned sequences are not in it;
    a word given as text is banned as its tokens at the start of a text and after a space."""
    free, _ = naive_decode(target, Penalties(), 24, temperature, seed=5)
    pairs = [tuple(free[i : i + 2]) for i in range(len(free) - 1)]
    bad_words = [(free[3],), pairs[6], (*pairs[1], 0)]  # one token, one of the answer's pairs, a longer one
    ref, _ = naive_decode(target, Penalties(bad_words=bad_words), 24, temperature, seed=5)
    assert ref != free and free[3] not in ref and all(tuple(ref[i : i + 2]) != pairs[6] for i in range(len(ref) - 1))
    for drafter in drafters(ref):
        gen = Generator(target, drafter, tree_size=6, max_depth=4)
        out = gen.generate(PROMPT, max_new_tokens=24, seed=5, temperature=temperature, bad_words=bad_words)
        assert out.token_ids == ref, drafter
    text_word = target.decode(list(pairs[6])).strip()
    tokens = bad_word_tokens([text_word], lambda w: target.encode(w, add_special_tokens=False))
    assert tuple(target.encode(text_word, add_special_tokens=False)) in tokens
    assert tuple(target.encode(" " + text_word, add_special_tokens=False)) in tokens
    gen = Generator(target)
    by_text = gen.generate(PROMPT, max_new_tokens=24, seed=5, temperature=temperature, bad_words=[text_word])
    assert (
        by_text.token_ids
        == gen.generate(PROMPT, max_new_tokens=24, seed=5, temperature=temperature, bad_words=list(tokens)).token_ids
    )
    for kwargs, why in [
        (dict(bad_words=[""]), "non-empty strings"),
        (dict(bad_words=[7]), "bad_words must be token-id sequences"),
        (dict(bad_words="t5"), "a list of non-empty strings"),
        (dict(bad_words=[[]]), "non-empty sequence of token ids"),
        (dict(bad_words=[[5, VOCAB]]), f"bad_words names token {VOCAB}, outside"),
        (dict(bad_words=["t5"], response_format="json_object"), "cannot be combined with a structured answer"),
    ]:
        with pytest.raises(DartspecError, match=why):
            gen.generate(PROMPT, max_new_tokens=4, **kwargs)


def test_rejection_tests_under_penalties_keep_the_penalised_distribution_exactly() -> None:
    """Sampled trees (drafts drawn from a drafter's distributions, tested by rejection) walk the penalised rows: the
    joint law of the first two committed tokens equals the exact penalised one, the second token's penalties
    counting the first (a chi-square test over all pairs; a token biased to -100 never comes)."""
    vocab, prompt = 5, [0, 2]  # the tree's root (token 0) is committed: it is the prompt's last token
    penalties = Penalties(repetition=1.5, presence=0.3, frequency=1.2, logit_bias={4: -100.0})
    params = SamplingParams(temperature=0.9, seed=0, penalties=penalties)
    rng = np.random.default_rng(7)
    root_logits = torch.tensor(rng.normal(size=vocab) * 1.5)
    after = torch.tensor(rng.normal(size=(vocab, vocab)) * 1.5)  # the target's row after each first token
    q_root, q_deep = rng.dirichlet(np.ones(vocab)), rng.dirichlet(np.ones(vocab))
    p_root = warp(naive(root_logits, penalties, prompt, []), params).numpy()
    exact = p_root[:, None] * np.stack(
        [warp(naive(after[a], penalties, prompt, [a]), params).numpy() for a in range(vocab)]
    )
    counts = np.zeros((vocab, vocab))
    n, accepted = 8000, 0
    for i in range(n):
        verifier = Verifier(SamplingParams(temperature=0.9, seed=i, penalties=penalties), prompt_ids=prompt)
        tree = _sampled_tree(rng, q_root, q_deep, fixed=int(np.argmax(p_root)))
        acc = verifier.accept(tree, torch.stack([root_logits, *(after[t] for t in tree.tokens[1:])]))
        toks = acc.tokens[:2]
        if len(toks) == 1:
            toks = [toks[0], verifier.next_token(after[toks[0]])]
        counts[toks[0], toks[1]] += 1
        accepted += acc.accepted_drafts > 0
    mask = exact > 1e-9
    assert counts[~mask].sum() == 0 and counts[4].sum() == 0 and counts[:, 4].sum() == 0
    expected = exact[mask] * n
    chi2 = float(((counts[mask] - expected) ** 2 / expected).sum())
    from scipy.stats import chi2 as chi2_dist

    assert chi2_dist.sf(chi2, df=mask.sum() - 1) > 1e-3, chi2
    assert accepted > n / 4  # the draws were tested, not bypassed


@pytest.mark.parametrize(
    "bad",
    [
        dict(repetition_penalty=0),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=float("inf")),
        dict(logit_bias={VOCAB: 1.0}),
        dict(logit_bias={3: 101}),
        dict(logit_bias={"3": 1}),
        dict(logit_bias={True: 1}),
    ],
)
def test_bad_penalties_are_refused(bad: dict) -> None:
    target = tiny_target("llama", seed=3, layers=2)
    with pytest.raises(DartspecError):
        Generator(target).generate(PROMPT, max_new_tokens=2, **bad)


def test_no_penalties_means_no_penalty_stage() -> None:
    assert not Penalties().active and not Penalties(logit_bias={3: 0.0}).active
    assert Penalties(logit_bias=[(4, 1), (2, -1.5)]).logit_bias == ((2, -1.5), (4, 1.0))
    assert Penalties(logit_bias={np.int64(2): 1}).logit_bias == ((2, 1.0),)
    with pytest.raises(DartspecError, match="twice"):
        Penalties(logit_bias=[(2, 1), (2, 3)])


def test_min_tokens_and_ignore_eos_against_a_naive_loop(target: Target) -> None:
    """A logit bias makes EOS (token 1) likely; ``min_tokens`` keeps it out of the first N tokens (EOS at -inf in those
    rows, each tree row by its own depth) and ``ignore_eos`` lets the answer run past it to the limit: for every
    drafter, greedy and seeded, the tokens of a naive loop over transformers' forward that does the same."""
    bias = {1: 4.0}

    def naive(n: int, min_tokens: int, ignore_eos: bool, temperature: float) -> list[int]:
        rng = torch.Generator().manual_seed(5)
        params = SamplingParams(temperature=temperature, seed=5)
        answer: list[int] = []
        while len(answer) < n and (ignore_eos or not answer or answer[-1] != 1):
            with torch.no_grad():
                x = target.model(torch.tensor([PROMPT + answer])).logits[0, -1].double()
            x[1] += 4.0
            if len(answer) < min_tokens:
                x[1] = -torch.inf
            u = float(torch.rand((), generator=rng, dtype=torch.float64))
            answer.append(int(x.argmax()) if temperature == 0 else sample(warp(x, params), u))
        return answer

    free = naive(24, 0, False, 0.0)
    assert len(free) < 8 and free[-1] == 1  # the bias ends the answer early (else the test could not fail)
    for temperature in (0.0, 0.9):
        for min_tokens, ignore_eos in ((10, False), (0, True), (6, True)):
            want = naive(24, min_tokens, ignore_eos, temperature)
            assert 1 not in want[:min_tokens] and (len(want) == 24 if ignore_eos else True)
            for drafter in drafters(want):
                gen = Generator(target, drafter, tree_size=6, max_depth=4)
                out = gen.generate(
                    PROMPT,
                    max_new_tokens=24,
                    temperature=temperature,
                    seed=5,
                    logit_bias=bias,
                    min_tokens=min_tokens,
                    ignore_eos=ignore_eos,
                )
                assert out.token_ids == want, (drafter, min_tokens, ignore_eos)
                assert out.finish_reason == ("length" if ignore_eos else "stop" if want[-1] == 1 else "length")
    with pytest.raises(DartspecError, match="min_tokens must be a non-negative integer"):
        Generator(target).generate(PROMPT, max_new_tokens=2, min_tokens=-1)
    with pytest.raises(DartspecError, match="cannot be combined with a structured answer"):
        Generator(target).generate(PROMPT, max_new_tokens=2, min_tokens=2, response_format="json_object")
