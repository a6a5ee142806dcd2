"""Tree builders: budgets, prefix closure, and the published scoring rules against brute force."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dartspec import exact
from dartspec.drafters.base import DraftBudget
from dartspec.ngram import MergedNgram, NgramModel, OnlineNgram, SmoothedNgram
from dartspec.search import BeamParams, BeamTree, ChainTree, DDTree, make_tree_builder, top_candidates


def random_logp(seed: int, d: int, v: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(d, v, generator=g, dtype=torch.float64) * 3, -1)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 1000),
    d=st.integers(1, 8),
    nodes=st.integers(1, 40),
    depth=st.integers(0, 8),
    kind=st.sampled_from(["beam", "ddtree", "chain"]),
)
def test_budget_depth_and_closure(seed: int, d: int, nodes: int, depth: int, kind: str) -> None:
    logp = random_logp(seed, d, 50)
    d2t = np.arange(50) + 100
    builder = make_tree_builder(kind, eos_ids=[101])
    tree = builder(7, logp, d2t, [1, 2, 3], DraftBudget(nodes, depth))
    assert tree.size <= nodes and tree.tokens[0] == 7
    assert tree.max_depth <= min(depth, d)
    assert all(t >= 100 for t in tree.tokens[1:])  # mapped through d2t
    again = builder(7, logp, d2t, [1, 2, 3], DraftBudget(nodes, depth))
    assert again.tokens.tolist() == tree.tokens.tolist() and again.parents.tolist() == tree.parents.tolist()


def beam_score(path: tuple[int, ...], lp: np.ndarray, p: BeamParams) -> float:
    return sum((lv + 1) ** -p.level_decay * p.logit_decay**lv * lp[lv, t] for lv, t in enumerate(path))


def test_beam_tree_is_the_prefix_closed_top_r_when_the_beam_is_exhaustive() -> None:
    d, v = 3, 4
    logp = random_logp(1, d, v)
    params = BeamParams(top_k=v, beam_width=v**d)
    lp = (logp - torch.logsumexp(logp, -1, keepdim=True)).numpy()
    for r in (2, 5, 9, 17):
        tree = BeamTree(params)(0, logp, None, [], DraftBudget(r, d))
        got = {tuple(int(tree.tokens[j]) for j in tree.path_to(i)[1:]) for i in range(1, tree.size)}
        paths = [pp for n in range(1, d + 1) for pp in itertools.product(range(v), repeat=n)]
        best = sorted(paths, key=lambda pp: -beam_score(pp, lp, params))[: r - 1]
        assert got == set(best)


def test_ngram_term_changes_the_ranking() -> None:
    logp = torch.log(torch.tensor([[0.9, 0.1, 1e-9], [0.45, 0.55, 1e-9], [0.5, 0.5, 1e-9]], dtype=torch.float64))
    plain = BeamTree(BeamParams(top_k=2))(9, logp, None, [9], DraftBudget(3, 3))
    assert plain.tokens.tolist() == [9, 0, 1] and plain.parents.tolist() == [-1, 0, 1]
    ngram, _ = NgramModel.build([[9, 0, 0, 0]] * 5, order=3, vocab=10)
    guided = BeamTree(BeamParams(top_k=2), ngram=ngram)(9, logp, None, [9], DraftBudget(3, 3))
    # The corpus only ever continues 0 -> 0, so the n-gram pulls depth 2 to token 0.
    assert guided.tokens.tolist() == [9, 0, 0] and guided.parents.tolist() == [-1, 0, 1]


def test_eos_is_not_expanded() -> None:
    logp = torch.log(torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.9, 0.1]], dtype=torch.float64))
    tree = BeamTree(BeamParams(top_k=2, beam_width=4), eos_ids=[0])(5, logp, None, [], DraftBudget(10, 3))
    for i in range(1, tree.size):
        if tree.tokens[i] == 0:
            assert tree.children(i) == []


def test_ddtree_is_optimal_for_its_surrogate() -> None:
    d, v = 3, 3
    logp = random_logp(4, d, v)
    lp = logp.numpy()
    for r in (2, 4, 7, 12):
        tree = DDTree(top_k=v)(0, logp, None, [], DraftBudget(r, d))
        got = sum(
            math.exp(sum(lp[lv, tree.tokens[j]] for lv, j in enumerate(tree.path_to(i)[1:])))
            for i in range(1, tree.size)
        )
        # Brute force: the best prefix-closed set of r-1 nodes maximises the sum of path products; since a
        # child's product never exceeds its parent's, taking the r-1 largest products is prefix-closed.
        paths = [pp for n in range(1, d + 1) for pp in itertools.product(range(v), repeat=n)]
        scores = sorted((math.exp(sum(lp[lv, t] for lv, t in enumerate(pp))) for pp in paths), reverse=True)
        assert got == pytest.approx(sum(scores[: r - 1]))


def test_chain_is_argmax_per_depth() -> None:
    logp = random_logp(2, 5, 30)
    tree = ChainTree()(1, logp, None, [], DraftBudget(16, 4))
    assert tree.tokens.tolist() == [1, *logp[:4].argmax(-1).tolist()]


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    nodes=st.integers(2, 30),
    use_ngram=st.booleans(),
    eos=st.sampled_from([(), (3,), (3, 5)]),
    rows=st.sampled_from([1, 8]),
    use_c=st.booleans(),
)
def test_narrow_beam_builds_the_same_tree_as_the_full_width(
    seed: int, nodes: int, use_ngram: bool, eos, rows: int, use_c: bool
) -> None:
    # One row (or two nodes) takes the single-level shortcut; EOS ranked high must still come last.
    rng = np.random.default_rng(seed)
    logp = random_logp(seed, rows, 60)
    if eos and seed % 2:
        logp[:, list(eos)] = logp.max() + 1.0
    ngram = None
    if use_ngram:
        ngram, _ = NgramModel.build([rng.integers(0, 60, size=400).tolist()], order=3, vocab=60)
    history = rng.integers(0, 60, size=5).tolist()
    budget = DraftBudget(max_nodes=nodes, max_depth=8)
    narrow = BeamTree(ngram=ngram, eos_ids=eos)
    full = BeamTree(ngram=ngram, eos_ids=eos)
    full.cap_width = False
    narrow.use_c = full.use_c = use_c
    a, b = narrow(1, logp, None, history, budget), full(1, logp, None, history, budget)
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    nodes=st.integers(2, 70),
    ngram_kind=st.sampled_from(["none", "static", "merged"]),
    eos=st.sampled_from([(), (3,), (3, 5, 7)]),
    rows=st.integers(2, 12),
    cap_width=st.booleans(),
)
def test_the_c_beam_search_builds_the_numpy_searchs_tree(
    seed: int, nodes: int, ngram_kind: str, eos: tuple[int, ...], rows: int, cap_width: bool
) -> None:
    """search.c against the numpy search (the reference): the same tree, node for node, where no scores tie."""
    rng = np.random.default_rng(seed)
    logp = random_logp(seed, rows, 300)
    for i, t in enumerate(eos):  # end tokens ranked high (distinct scores, so no tie decides)
        if seed % 2:
            logp[:, t] = logp.max() + 0.5 + 0.1 * i
    ngram = None
    if ngram_kind != "none":
        # Few distinct tokens, so contexts repeat and the n-gram term decides many ranks.
        ngram, _ = NgramModel.build([rng.integers(0, 40, size=3000).tolist()], order=3 + seed % 2, vocab=300)
        ngram = MergedNgram(ngram, None) if ngram_kind == "merged" else ngram
    history = rng.integers(0, 40, size=int(rng.integers(0, 6))).tolist()
    d2t = rng.permutation(1000)[:300] if seed % 3 == 0 else None
    budget = DraftBudget(max_nodes=nodes, max_depth=rows)
    c, ref = BeamTree(ngram=ngram, eos_ids=eos), BeamTree(ngram=ngram, eos_ids=eos)
    c.cap_width = ref.cap_width = cap_width
    ref.use_c = False
    a, b = c(1, logp, d2t, history, budget), ref(1, logp, d2t, history, budget)
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    if rows > 1 and nodes > 2:
        assert c._c_search(1, *top_candidates(logp, 25, d2t), history, budget) is not None  # the C path ran


def test_online_and_smoothed_ngrams_take_the_numpy_search() -> None:
    model, _ = NgramModel.build([list(range(50)) * 3], order=3, vocab=60)
    online = OnlineNgram(3)
    online.extend(list(range(20)))
    cand, lp = top_candidates(random_logp(0, 4, 60), 25, None)
    budget = DraftBudget(max_nodes=8, max_depth=4)
    for scorer in (MergedNgram(model, online), online, SmoothedNgram(model, 0.5)):
        assert BeamTree(ngram=scorer)._c_search(1, cand, lp, [1, 2], budget) is None


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 8),
    vocab=st.integers(1, 400),
    k=st.integers(1, 70),
    mapped=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_c_top_candidates_equal_torchs(
    seed: int, rows: int, vocab: int, k: int, mapped: bool, dtype: torch.dtype
) -> None:
    """search.c's top-k against torch's topk and float32 renormalisation (the reference, and the path without the
    kernels): the same ids in the same order, the same log-probs but for float rounding."""
    from dartspec import search

    assert search._c_top_candidates() is not None
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randperm(rows * vocab, generator=g).view(rows, vocab).double() * 0.01, -1)
    logp = logp.to(dtype)  # distinct values: no tie decides an order
    d2t = np.random.default_rng(seed).permutation(5 * vocab)[:vocab] if mapped else None
    ids, lp = top_candidates(logp, k, d2t)
    vals, idx = torch.topk(logp.float(), min(k, vocab), dim=-1)
    want = idx.numpy() if d2t is None else d2t[idx.numpy()]
    assert ids.dtype == np.int64 and lp.dtype == np.float64 and ids.shape == (rows, min(k, vocab))
    assert (ids == want).all()
    np.testing.assert_allclose(lp, (vals - torch.logsumexp(vals, -1, keepdim=True)).double().numpy(), atol=1e-5)
    if min(k, vocab) <= 64:  # the kernel's limit (past it torch's path runs): renormalised in doubles
        np.testing.assert_allclose(np.logaddexp.reduce(lp, axis=-1), 0.0, atol=1e-12)


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
def test_c_top_candidates_rank_equal_values_by_index() -> None:
    logp = torch.tensor([[-1.0, -3.0, -1.0, -2.0, -1.0, -2.0]])
    ids, lp = top_candidates(logp, 4, None)
    assert ids.tolist() == [[0, 2, 4, 3]]
    assert lp[0, 0] == lp[0, 1] == lp[0, 2] > lp[0, 3]


def test_sampled_tree_draws_from_the_first_row_at_the_temperature_inside_the_builders_tree() -> None:
    """``sampled_tree``: the drawn token follows softmax(row 0 / T) (chi-square over 6 tokens), is a root child named
    by the root's proposal, and the rest is the builder's tree: all of it where it holds the token, less its last
    node otherwise; never over the budget."""
    from dartspec.search import sampled_tree
    from dartspec.tree import DraftSampling

    d2t = np.array([11, 3, 7, 20, 5, 9])  # draft index -> target id
    logp = random_logp(4, 3, 6)
    temperature = 0.7
    sampling = DraftSampling(temperature, np.random.default_rng(0))
    builder = BeamTree(BeamParams(beam_width=2, top_k=3))
    counts = np.zeros(6)
    for nodes in (2, 3, 5) * 600:
        budget = DraftBudget(max_nodes=nodes, max_depth=3, sampling=sampling)
        tree = sampled_tree(builder, 1, logp, d2t, [1], budget)
        proposal = tree.proposals[0]
        (drawn,), (at,) = proposal.draws, proposal.at
        assert tree.parents[drawn] == 0 and tree.tokens[drawn] == d2t[at] and tree.size <= nodes
        plain = builder(1, logp, d2t, [1], budget)
        if plain.child_with_token(0, int(d2t[at])) is not None:
            assert tree.tokens.tolist() == plain.tokens.tolist()
        else:
            assert tree.tokens.tolist() == [*plain.tokens[: nodes - 1].tolist(), d2t[at]]
        counts[at] += 1
    expected = torch.softmax(logp[0] / temperature, -1).numpy() * counts.sum()
    assert np.allclose(proposal.probs * counts.sum(), expected)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    from scipy.stats import chi2 as chi2_dist

    assert chi2_dist.sf(chi2, df=5) > 1e-3, (counts, expected)
