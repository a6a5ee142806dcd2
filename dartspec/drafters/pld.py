"""Prompt lookup decoding: propose what followed earlier occurrences of the current suffix.

No model: the last n tokens (n from ``max_ngram`` down to ``min_ngram``) are searched for earlier in
the context, and the tokens that followed the most recent matches become the draft. One match gives
a chain; several distinct continuations are merged into a small tree.

Verifying a span is not free where rows cost time (a CPU: on a 2-core EPYC, 4 rows of Qwen2.5-Coder-1.5B cost 1.47x
one row, of SmolLM2 1.34x), and a span that is rarely right then makes decoding slower than plain. With
``--tree-size auto`` a :class:`LookupGate` cuts each step's spans to the number and depth with the most expected tokens
per second of verification, on the machine's verify cost curve (:mod:`dartspec.tree_size`) and on how often this
answer's spans turned out right, down to no draft at all; without it 16 nodes of spans would be verified whenever the
context matched. At the default budget (4 nodes) the gate measured even with verifying every span (SmolLM2, 40
development prompts: 1.21x plain decoding against 1.20x; Qwen2.5-Coder-1.5B, MT-Bench 10: 0.99x against 1.04x, each
within the other's spread), so the default stays the plain rule.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dartspec.drafters.base import DraftBudget, DrafterBase
from dartspec.ngram import _address
from dartspec.tree import Tree
from dartspec.tree_size import CostCurve, calibrate

#: Depths the gate keeps statistics for; deeper span tokens are never proposed by a gate.
GATE_DEPTH = 16
#: What the gate assumes before an answer has shown anything: the share of steps whose newest span the answer
#: follows for at least 1, 2, ... tokens (given a span that long), roughly as measured over every step of 14 greedy
#: answers of Qwen2.5-Coder-1.5B to development prompts (ShareGPT 14100+): 0.65, 0.49, 0.39, 0.33, 0.29, ...
GATE_PRIOR = np.array([0.6, 0.45, 0.35, 0.3, 0.25, 0.22, 0.2, 0.18, *([0.16] * (GATE_DEPTH - 8))])


@functools.cache
def _c_lookup() -> Any:
    """:meth:`PromptLookupDrafter.continuations` in C (``ngram.c``), or None where dartspec's kernels cannot be
    built."""
    from dartspec import exact

    return exact.kernel("dartspec_lookup")


def followed(spans: Sequence[Sequence[int]], truth: Sequence[int]) -> int:
    """How many leading tokens of ``truth`` the best of ``spans`` matches (what greedy verification accepts)."""
    best = 0
    for span in spans:
        k = 0
        while k < len(span) and k < len(truth) and span[k] == truth[k]:
            k += 1
        best = max(best, k)
    return best


@dataclass
class LookupGate:
    """Chooses how many of a step's spans (newest first) and how deep to verify, or none, to maximise expected
    tokens per second: (1 + sum of the chosen depths' acceptance rates) / T(nodes), against 1 / T(1) for no draft.

    The rates are learned from outcomes that need no verification: every step's spans, drafted or not, are scored
    against the tokens the answer then committed (the depth greedy verification would have accepted), so a gate
    that stopped drafting keeps learning and drafts again when the answer starts repeating itself. Statistics are
    kept per number of spans (the best of the first s) and depth, decayed per step so that they follow the answer;
    a new answer starts from the last one's (the next is often alike)."""

    curve: CostCurve
    max_spans: int = 3
    decay: float = 0.95  # per scored step: about the last 20 steps with spans count
    strength: float = 2.0  # the prior counts as this many steps
    hits: np.ndarray = field(init=False)
    counts: np.ndarray = field(init=False)
    prior: np.ndarray = field(init=False)  # (max_spans, GATE_DEPTH): GATE_PRIOR, a little higher for more spans
    pending: list[tuple[int, list[list[int]]]] = field(default_factory=list)  # (where the truth starts, spans)

    def __post_init__(self) -> None:
        self.hits = np.zeros((self.max_spans, GATE_DEPTH))
        self.counts = np.zeros((self.max_spans, GATE_DEPTH))
        self.prior = GATE_PRIOR[None, :] * (1.0 + 0.05 * np.arange(self.max_spans))[:, None]

    def begin(self) -> None:
        self.pending = []

    def copy(self) -> LookupGate:
        twin = LookupGate(self.curve, self.max_spans, self.decay, self.strength)
        twin.hits, twin.counts = self.hits.copy(), self.counts.copy()
        return twin

    def rates(self) -> np.ndarray:
        """``(max_spans, GATE_DEPTH)``: the chance that the best of the first s spans is followed for >= k tokens."""
        return (self.hits + self.strength * self.prior) / (self.counts + self.strength)

    def score(self, tokens: Sequence[int]) -> None:
        """Learn from the earlier steps' spans whose outcome ``tokens`` (all committed) now decides."""
        waiting = []
        for start, spans in self.pending:
            truth = list(tokens[start : start + max(len(p) for p in spans)])
            if any(len(p) > len(truth) and list(p[: len(truth)]) == truth for p in spans):
                waiting.append((start, spans))  # a span still matches all there is and goes on: not decided yet
                continue
            self.hits *= self.decay
            self.counts *= self.decay
            for s in range(1, len(spans) + 1):
                first = spans[:s]
                self.counts[s - 1, : max(len(p) for p in first)] += 1
                self.hits[s - 1, : followed(first, truth)] += 1
        self.pending = waiting

    def cut(self, tokens: Sequence[int], spans: list[list[int]], max_nodes: int) -> list[list[int]]:
        """The spans to verify: the first s of ``spans``, each cut at depth D, for the best (s, D); [] when no draft
        beats plain decoding. ``spans`` are remembered and scored once the answer has gone past them."""
        self.score(tokens)
        spans = [span[:GATE_DEPTH] for span in spans[: self.max_spans]]
        self.pending.append((len(tokens), spans))
        rates = self.rates()
        costs = self.curve.cost(np.arange(1, max_nodes + 1))
        best_rate, choice = 1.0 / costs[0], (0, 0)
        for s in range(1, len(spans) + 1):
            nodes: set[tuple[int, ...]] = set()
            gain = 1.0
            for depth in range(1, max(len(p) for p in spans[:s]) + 1):
                nodes.update(tuple(p[:depth]) for p in spans[:s])
                if len(nodes) + 1 > max_nodes:
                    break
                gain += rates[s - 1, depth - 1]
                rate = gain / costs[len(nodes)]
                if rate > best_rate:
                    best_rate, choice = rate, (s, depth)
        s, depth = choice
        return [span[:depth] for span in spans[:s]] if s else []


class PromptLookupDrafter(DrafterBase):
    """Prompt lookup (PLD) as a tree drafter."""

    name = "pld"

    def __init__(
        self, max_ngram: int = 3, min_ngram: int = 2, max_matches: int = 3, gate: LookupGate | None = None
    ) -> None:
        """``gate``: cut each step's spans by expected tokens per second (:class:`LookupGate`); None: verify every
        span the budget holds."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches
        self.gate = gate

    def begin(self, prompt_ids: Sequence[int]) -> None:
        if self.gate is not None:
            self.gate.begin()

    def _own_state(self) -> None:
        if self.gate is not None:
            self.gate = self.gate.copy()

    def continuations(self, tokens: Sequence[int], length: int) -> list[list[int]]:
        """Up to ``max_matches`` distinct continuations of the longest matching suffix, newest first (in C where
        dartspec's kernels build: the same search, a fifth of the numpy one's time in a decode)."""
        seq = np.ascontiguousarray(tokens, dtype=np.int64)
        kernel = _c_lookup()
        if kernel is not None:
            out = np.empty((self.max_matches, max(length, 0)), dtype=np.int64)
            lengths = np.empty(self.max_matches, dtype=np.int64)
            found = kernel(
                _address(seq), len(seq), self.max_ngram, self.min_ngram, length, self.max_matches,
                _address(out), _address(lengths),
            )  # fmt: skip
            return [out[c, : lengths[c]].tolist() for c in range(found)]
        n_tok = len(seq)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            suffix = seq[n_tok - n :]
            # Candidate starts i with seq[i:i+n] == suffix and i + n < n_tok (something follows).
            hits = np.ones(n_tok - n, dtype=bool)
            for k in range(n):
                hits &= seq[k : n_tok - n + k] == suffix[k]
            starts = np.flatnonzero(hits)[::-1]
            found: list[list[int]] = []
            seen: set[tuple[int, ...]] = set()
            for s in starts:
                cont = seq[s + n : s + n + length].tolist()
                key = tuple(cont)
                if cont and key not in seen:
                    seen.add(key)
                    found.append(cont)
                    if len(found) == self.max_matches:
                        break
            if found:
                return found
        return []

    def spans(self, tokens: Sequence[int], budget: DraftBudget) -> list[list[int]]:
        """:meth:`continuations` as deep as ``budget`` allows, cut by the gate if there is one; none without room
        beside the root (a full batch's share), where the search, a scan of the whole context, is skipped."""
        if budget.max_depth < 1 or budget.max_nodes < 2:
            return []
        found = self.continuations(tokens, budget.max_depth)
        if self.gate is None or not found:
            return found
        return self.gate.cut(tokens, found, budget.max_nodes)

    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        return Tree.from_paths(tokens[-1], self.spans(tokens, budget), max_nodes=budget.max_nodes)


def build(target: Any, options: Any) -> PromptLookupDrafter:
    """The registry's builder of ``pld``: gated (:class:`LookupGate`, on the target's cost curve, measured once per
    machine) where ``options.auto_size`` asks for sizing per step (``--tree-size auto``)."""
    if not options.auto_size:
        return PromptLookupDrafter()
    return PromptLookupDrafter(gate=LookupGate(calibrate(target)))
