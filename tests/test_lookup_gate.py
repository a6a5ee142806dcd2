"""Prompt lookup's gate: spans cut to the best expected tokens per second on a cost curve, learned from outcomes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import tiny_target

from dartspec import exact
from dartspec.drafters.base import NoDrafter
from dartspec.drafters.hybrid import HybridDrafter
from dartspec.drafters.pld import GATE_DEPTH, LookupGate, PromptLookupDrafter, followed
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.tree import DraftBudget, Tree
from dartspec.tree_size import CostCurve

STEEP = CostCurve((1, 2, 4, 8), (1.0, 1.3, 1.9, 3.1))  # each row ~30% of a step: a span must be right to pay
FLAT = CostCurve((1, 32), (1.0, 1.0))


def test_followed_is_the_longest_matching_prefix() -> None:
    assert followed([[1, 2, 3], [1, 2, 4, 5]], [1, 2, 4, 6]) == 3
    assert followed([[7]], [1]) == 0 and followed([[1, 2]], [1]) == 1 and followed([], [1]) == 0


@pytest.mark.parametrize("seed", range(6))
def test_the_cut_is_the_best_rate_over_every_number_of_spans_and_depth(seed: int) -> None:
    rng = np.random.default_rng(seed)
    gate = LookupGate(CostCurve((1, 3, 6), (1.0, 1.25, 2.0)))
    gate.hits = rng.uniform(0, 5, size=gate.hits.shape)
    gate.counts = gate.hits + rng.uniform(0, 5, size=gate.hits.shape)
    rates = gate.rates()
    base = [int(t) for t in rng.integers(0, 3, size=2)]  # shared prefixes: spans merge into a trie
    spans = [base + rng.integers(0, 4, size=int(rng.integers(1, 6))).tolist() for _ in range(3)]
    got = gate.cut([5, 6], spans, max_nodes=6)
    # Brute force with the tree itself counting the nodes: the rate of each (s, D) that fits the budget.
    best, best_rate = [], 1.0 / float(gate.curve.cost(1))
    for s, depth in itertools.product(range(1, 4), range(1, GATE_DEPTH)):
        cut = [span[:depth] for span in spans[:s]]
        if depth > max(len(span) for span in spans[:s]):
            continue
        size = Tree.from_paths(6, cut).size
        rate = (1 + rates[s - 1, :depth].sum()) / float(gate.curve.cost(size))
        if size <= 6 and rate > best_rate + 1e-12:
            best, best_rate = cut, rate
    assert got == best


def drive(gate: LookupGate, answer_follows: bool, steps: int, start: list[int]) -> list[list[list[int]]]:
    """Steps of a decode whose lookup span is always [1, 2, 3]: the answer goes on with it and a new token, or with
    a token of its own (the same, drafted or not: decoding is lossless). Returns each step's cut."""
    tokens, cuts = list(start), []
    for _ in range(steps):
        cuts.append(gate.cut(tokens, [[1, 2, 3]], max_nodes=4))
        tokens += [1, 2, 3, 9] if answer_follows else [8]
    return cuts


def test_the_gate_stops_drafting_spans_that_fail_and_drafts_again_when_they_hold() -> None:
    gate = LookupGate(STEEP)
    assert drive(gate, False, 1, [4, 5])[0] == [[1, 2]]  # the prior expects a span to pay for 2 rows, not 3
    cuts = drive(gate, False, 12, [4, 5])
    assert cuts[-1] == [] and gate.rates()[0, 0] < 0.15
    # Undrafted spans are still scored against what the answer committed: they come back once they hold.
    cuts = drive(gate, True, 12, [4, 5])
    assert cuts[-1] == [[1, 2, 3]] and gate.rates()[0, 0] > 0.5
    # Where rows are free every span is worth verifying, right or not.
    free = LookupGate(FLAT)
    assert drive(free, False, 20, [4, 5])[-1] == [[1, 2, 3]]


def test_an_undecided_span_waits_for_the_answer() -> None:
    gate = LookupGate(STEEP)
    gate.cut([4, 5], [[1, 2, 3]], max_nodes=4)
    gate.score([4, 5, 1, 2])  # all of it matched so far, and the span goes on
    assert len(gate.pending) == 1 and gate.counts.sum() == 0
    gate.score([4, 5, 1, 2, 7])
    assert gate.pending == [] and gate.counts[0, :3].tolist() == [1, 1, 1] and gate.hits[0, :3].tolist() == [1, 1, 0]


def test_forks_learn_apart() -> None:
    lookup = PromptLookupDrafter(gate=LookupGate(STEEP))
    twin = lookup.fork()
    assert twin.gate is not lookup.gate
    drive(twin.gate, False, 5, [4, 5])
    assert lookup.gate.counts.sum() == 0 and twin.gate.counts.sum() > 0
    hybrid = HybridDrafter(NoDrafter(), PromptLookupDrafter(gate=LookupGate(STEEP)))  # a gated lookup inside dart+pld
    assert hybrid.fork().lookup.gate is not hybrid.lookup.gate


def test_the_cost_curve_goes_on_past_its_last_size() -> None:
    curve = CostCurve((1, 16, 32), (1.0, 2.0, 4.0))
    assert float(curve.cost(48)) == pytest.approx(6.0) and float(curve.cost(0)) == pytest.approx(1.0)


def test_prompt_lookup_is_gated_with_auto_only(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DARTSPEC_CACHE", str(tmp_path))  # the calibration is measured here, once
    target = tiny_target()
    auto = build_generator(target, GeneratorSpec(drafter="pld", tree_size="auto"))
    assert auto.tree_size == 16 and auto.drafter.gate is not None
    assert list((tmp_path / "calibration").glob("*.json"))
    for spec in (GeneratorSpec(drafter="pld"), GeneratorSpec(drafter="pld", tree_size=4)):
        assert build_generator(target, spec).drafter.gate is None
    # A gated decode proposes within the budget and stays lossless (greedy equals plain decoding).
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    plain = build_generator(target, GeneratorSpec()).generate(prompt, max_new_tokens=24).token_ids
    assert auto.generate(prompt, max_new_tokens=24).token_ids == plain
    tree = auto.drafter.propose([3, 4, 5, 3, 4], DraftBudget(max_nodes=4, max_depth=8))
    assert tree.size <= 4


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
def test_the_c_lookup_finds_the_numpy_searchs_continuations(monkeypatch) -> None:
    """ngram.c's prompt lookup against the numpy search (the reference, and the path without the kernels): the same
    continuations in the same order, over random short texts of few distinct tokens (many repeats) and settings."""
    from dartspec.drafters import pld

    assert pld._c_lookup() is not None
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(1500):
        low = int(rng.integers(1, 4))
        drafter = PromptLookupDrafter(
            max_ngram=low + int(rng.integers(0, 3)), min_ngram=low, max_matches=int(rng.integers(1, 5))
        )
        tokens = rng.integers(0, int(rng.integers(1, 6)), size=int(rng.integers(0, 60))).tolist()
        cases.append((drafter, tokens, int(rng.integers(0, 10))))
    found = [d.continuations(t, n) for d, t, n in cases]
    monkeypatch.setattr(pld, "_c_lookup", lambda: None)
    assert found == [d.continuations(t, n) for d, t, n in cases]
    assert sum(map(bool, found)) > 1000 and any(len(f) > 1 for f in found)  # the cases do find continuations
