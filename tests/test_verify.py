"""Verification: greedy longest match, and sampling that is exactly the target distribution."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from dartspec.errors import DartspecError
from dartspec.tree import Proposal, Tree
from dartspec.verify import SamplingParams, Verifier, sample, warp


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": -3}, "seed"),
        ({"seed": 2**64}, "seed"),  # an overflow in torch's generator at the first draw before
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
    ],
)
def test_invalid_sampling_params(kwargs: dict, needle: str) -> None:
    with pytest.raises(DartspecError, match=needle):
        SamplingParams(**kwargs)


def test_the_largest_seed_is_taken() -> None:
    """The largest seed SamplingParams admits seeds both of the verifier's generators."""
    verifier = Verifier(SamplingParams(temperature=1.0, seed=2**64 - 1), sampled_drafts=True)
    assert 0.0 <= verifier._uniform() < 1.0 and verifier.draft_sampling is not None


def brute_warp(logits: np.ndarray, t: float, top_k: int, top_p: float) -> np.ndarray:
    s = logits / t
    if top_k:
        kth = np.sort(s)[::-1][top_k - 1]
        s = np.where(s < kth, -np.inf, s)
    p = np.exp(s - s.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        keep, mass = [], 0.0
        for i in order:
            keep.append(i)
            mass += p[i]
            if mass >= top_p:
                break
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return p


@pytest.mark.parametrize(("t", "k", "p"), [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.5, 4, 0.6)])
def test_warp_matches_reference(t: float, k: int, p: float) -> None:
    logits = np.random.default_rng(0).normal(size=9) * 2
    got = warp(torch.tensor(logits), SamplingParams(temperature=t, top_k=k, top_p=p)).numpy()
    np.testing.assert_allclose(got, brute_warp(logits, t, k, p), atol=1e-12)


@pytest.mark.parametrize(
    ("t", "k", "p", "m"), [(1.0, 0, 1.0, 0.1), (0.7, 5, 1.0, 0.3), (1.3, 0, 0.9, 0.05), (0.5, 6, 0.8, 0.5)]
)
def test_warp_matches_transformers_warpers(t: float, k: int, p: float, m: float) -> None:
    """Independent reference: transformers' temperature, top-k, top-p and min-p warpers in its own order."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.tensor(np.random.default_rng(3).normal(size=(1, 40)) * 2)
    scores = TemperatureLogitsWarper(t)(None, logits.clone())
    warpers = ((TopKLogitsWarper, k, k > 0), (TopPLogitsWarper, p, p < 1), (MinPLogitsWarper, m, m > 0))
    for warper, value, on in warpers:
        scores = warper(value)(None, scores) if on else scores
    want = torch.softmax(scores, -1)[0]
    got = warp(logits[0], SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m))
    assert int((got > 0).sum()) < 40 and torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-12)


def test_inverse_cdf_sampling() -> None:
    p = torch.tensor([0.0, 0.25, 0.0, 0.75], dtype=torch.float64)
    assert [sample(p, u) for u in (0.0, 0.2499, 0.25, 0.9999)] == [1, 1, 3, 3]
    # u * total at the very end (u = 1, or rounding): the last token with mass, never a trailing zero's
    assert sample(torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64), 1.0) == 1


def test_greedy_accepts_longest_matching_path() -> None:
    #        0(root)
    #       /      \
    #     1:a=5    2:b=6
    #     |         |
    #     3:c=7    4:d=8
    tree = Tree(np.array([0, 5, 6, 7, 8]), np.array([-1, 0, 0, 1, 2]))
    logits = torch.full((5, 10), -5.0)
    argmax = {0: 6, 1: 7, 2: 8, 3: 1, 4: 9}  # root -> 6 (node 2) -> 8 (node 4) -> bonus 9
    for node, tok in argmax.items():
        logits[node, tok] = 5.0
    acc = Verifier(SamplingParams()).accept(tree, logits)
    assert acc.path == [0, 2, 4] and acc.tokens == [6, 8, 9] and acc.accepted_drafts == 2


def test_sampled_tokens_follow_the_target_distribution_exactly() -> None:
    """Joint law of the first two committed tokens equals the target's, whatever the tree.

    Row i of the logits is the target distribution after node i; for a token sequence that leaves the
    tree, the next distribution comes from the bonus position. We compare with exact probabilities by a
    chi-square test over all 25 pairs.
    """
    vocab = 5
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.95, seed=0)
    rng = np.random.default_rng(1)
    tree = Tree(np.array([0, 2, 3, 1, 4]), np.array([-1, 0, 0, 1, 2]))  # root->2->1, root->3->4
    logits = torch.tensor(rng.normal(size=(5, vocab)) * 1.5)
    # Distribution of the second token when the first leaves the tree: the real target would compute it in
    # the next step; give every outside token its own fixed row so we can write the exact law.
    outside = torch.tensor(rng.normal(size=(vocab, vocab)) * 1.5)
    p_root = warp(logits[0], params).numpy()
    exact = np.zeros((vocab, vocab))
    for a in range(vocab):
        child = tree.child_with_token(0, a)
        row = logits[child] if child is not None else outside[a]
        exact[a] = p_root[a] * warp(row, params).numpy()

    verifier = Verifier(params)
    counts = np.zeros((vocab, vocab))
    n = 20000
    for _ in range(n):
        acc = verifier.accept(tree, logits)
        toks = acc.tokens
        if len(toks) == 1:  # left the tree at the root: sample the next token as the next step would
            toks = [toks[0], verifier.next_token(outside[toks[0]])]
        counts[toks[0], toks[1]] += 1
    mask = exact > 0
    assert counts[~mask].sum() == 0, "sampled a token the warped target gives probability 0"
    expected = exact[mask] * n
    chi2 = float(((counts[mask] - expected) ** 2 / expected).sum())
    from scipy.stats import chi2 as chi2_dist

    assert chi2_dist.sf(chi2, df=mask.sum() - 1) > 1e-3, chi2


def test_one_uniform_per_token_makes_drafting_invisible() -> None:
    """With one seed, the committed tokens do not depend on what the tree proposed."""
    rng = np.random.default_rng(3)
    logits_by_prefix: dict[tuple[int, ...], torch.Tensor] = {}

    def row(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in logits_by_prefix:
            logits_by_prefix[prefix] = torch.tensor(rng.normal(size=6))
        return logits_by_prefix[prefix]

    params = SamplingParams(temperature=1.0, seed=11)
    plain = Verifier(params)
    plain_tokens: list[int] = []
    for _ in range(12):
        plain_tokens.append(plain.next_token(row(tuple(plain_tokens))))
    for trial in range(5):
        spec = Verifier(params)
        out: list[int] = []
        while len(out) < 12:
            paths = [list(p) for p in itertools.islice(itertools.product(range(6), repeat=2), trial, trial + 6, 2)]
            tree = Tree.from_paths(0, paths)
            logits = torch.stack(
                [row(tuple(out) + tuple(int(tree.tokens[j]) for j in tree.path_to(i)[1:])) for i in range(tree.size)]
            )
            out.extend(spec.accept(tree, logits).tokens)
        assert out[:12] == plain_tokens


def _sampled_tree(rng: np.random.Generator, q_root: np.ndarray, q_deep: np.ndarray, fixed: int) -> Tree:
    """A tree as a sampling drafter makes one: two tokens drawn at the root without replacement from ``q_root``,
    one drawn below the first from ``q_deep``, and the fixed guess ``fixed`` at the root (where not drawn)."""
    ids = np.arange(len(q_root))
    a1 = int(rng.choice(ids, p=q_root))
    rest = q_root.copy()
    rest[a1] = 0
    a2 = int(rng.choice(ids, p=rest / rest.sum()))
    b = int(rng.choice(ids, p=q_deep))
    tokens, parents = [0, a1, a2, b], [-1, 0, 0, 1]
    if fixed not in (a1, a2):
        tokens.append(fixed)
        parents.append(0)
    proposals = {0: Proposal(ids, q_root, (1, 2), (a1, a2)), 1: Proposal(ids, q_deep, (3,), (b,))}
    return Tree(np.array(tokens), np.array(parents), proposals)


def test_rejection_tests_of_sampled_drafts_keep_the_target_distribution_exactly() -> None:
    """Joint law of the first two committed tokens equals the target's when the tree's nodes were drawn from a
    drafter's distributions (not the target's, and with mass where the warped target has none) and tested by
    rejection, draws without replacement and a fixed guess after them: a chi-square test over all 25 pairs."""
    vocab = 5
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.95, seed=0)
    rng = np.random.default_rng(7)
    root_logits = torch.tensor(rng.normal(size=vocab) * 1.5)
    after = torch.tensor(rng.normal(size=(vocab, vocab)) * 1.5)  # the target's row after each first token
    q_root, q_deep = rng.dirichlet(np.ones(vocab)), rng.dirichlet(np.ones(vocab))
    p_root = warp(root_logits, params).numpy()
    exact = p_root[:, None] * np.stack([warp(after[a], params).numpy() for a in range(vocab)])

    verifier = Verifier(params)
    counts = np.zeros((vocab, vocab))
    n, accepted = 20000, 0
    for _ in range(n):
        tree = _sampled_tree(rng, q_root, q_deep, fixed=int(np.argmax(p_root)))
        rows = [root_logits, *(after[t] for t in tree.tokens[1:])]  # deeper rows: never the first two tokens' law
        acc = verifier.accept(tree, torch.stack(rows))
        toks = acc.tokens[:2]
        if len(toks) == 1:
            toks = [toks[0], verifier.next_token(after[toks[0]])]
        counts[toks[0], toks[1]] += 1
        accepted += acc.accepted_drafts > 0
    mask = exact > 0
    assert counts[~mask].sum() == 0, "committed a token the warped target gives probability 0"
    expected = exact[mask] * n
    chi2 = float(((counts[mask] - expected) ** 2 / expected).sum())
    from scipy.stats import chi2 as chi2_dist

    assert chi2_dist.sf(chi2, df=mask.sum() - 1) > 1e-3, chi2
    assert accepted > n / 3  # the test went through the draws, not around them


def test_a_draft_drawn_from_the_targets_own_distribution_is_always_accepted() -> None:
    """Rejection tests accept a draw from q with min(1, p / q): with q = p every draw is kept (matching the target's
    own sample would keep it with probability p(x) only)."""
    params = SamplingParams(temperature=1.0, seed=0)
    rng = np.random.default_rng(2)
    logits = torch.tensor(rng.normal(size=(2, 6)))
    p = warp(logits[0], params).numpy()
    verifier = Verifier(params)
    for _ in range(300):
        at = int(rng.choice(6, p=p))
        tree = Tree(np.array([0, at]), np.array([-1, 0]), {0: Proposal(np.arange(6), p, (1,), (at,))})
        assert verifier.accept(tree, logits).path == [0, 1]


def test_sampled_drafts_are_drawn_only_for_sampled_requests() -> None:
    """The verifier hands drafters a seeded sampler only where it tests draws (sampled requests, when asked)."""
    assert Verifier(SamplingParams(), sampled_drafts=True).draft_sampling is None
    assert Verifier(SamplingParams(temperature=0.7, seed=1)).draft_sampling is None
    hot = Verifier(SamplingParams(temperature=0.7, seed=1), sampled_drafts=True).draft_sampling
    again = Verifier(SamplingParams(temperature=0.7, seed=1), sampled_drafts=True).draft_sampling
    assert hot is not None and again is not None and hot.temperature == 0.7
    assert hot.rng.random() == again.rng.random()  # seeded with the request
