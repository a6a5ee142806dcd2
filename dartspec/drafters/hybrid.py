"""DART plus prompt lookup in one tree: copied spans as extra branches (and ``draft-model+pld``: a draft model's chain
where the lookup finds no span, :func:`build_draft_model`).

Prompt lookup is nearly free and very precise when the answer repeats the prompt or itself (code, extraction, the
loops a small model falls into), and it proposes nothing otherwise; the DART drafter guesses everywhere but rarely
far. The hybrid verifies both within one budget of nodes: the lookup continuations (when the context has a match)
come first, and the DART tree fills the nodes they leave; without a match the DART tree has them all. Replayed on
SmolLM2's development answers (ShareGPT 14000+, 40 answers; ``docs/bench/hybrid-replay-2026-11-26/``) this took DART's
tau at 16 nodes from 2.72 to 3.32 and at 4 nodes from 2.15 to 2.30; letting DART's tree go first, or spans reach
deeper than DART's rows, gained nothing at 16 nodes and at most 3% at 32.

Where verifying a node is not nearly free (a CPU), the two sources want different budgets: a span is often right
for several tokens (prompt lookup's best size there is 4 nodes), DART's guesses past its second rarely pay.
``draft_nodes`` caps the DART tree's own nodes inside the budget: the CPU default is 4 nodes with DART's tree at 3
(:data:`dartspec.engine.CPU_LOOKUP_DRAFT_NODES`). When a batched step shares its rows among sequences,
what the batch takes from a sequence's tree comes out of DART's share first: each sequence's drafter runs on its
own, and a span's node is the better bet (the CPU engine, 2 sequences a step of 4 rows, 1 thread: 1.07x plain
decoding instead of 0.99x, as prompt lookup alone).

Long contexts are the lookup's: ``draft_context`` stops the network drafting once the context is longer (for the
whole sequence, since it only grows; a longer prompt never starts it). A network drafter first reads every prompt
position's features through its layer (for SmolLM2's DART, ~170 ms for 1,400 positions on 2 cores, a cost no answer
of a few hundred tokens wins back), each of its steps attends over the whole context, and so does each verified row
(SmolLM2, 2 cores: T(4) - T(1) 3.5 ms at 256 positions, 4.8 ms at 1,536). On summaries of 800-1,400 token texts
the CPU default ran at 0.72-0.94x plain decoding while prompt lookup alone ran at 0.98-1.13x; on 430-630 tokens the
two were even (:data:`dartspec.engine.CPU_LOOKUP_DRAFT_CONTEXT`, BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from dartspec.drafters.base import DraftBudget, Drafter, DrafterBase
from dartspec.drafters.options import DrafterOptions
from dartspec.drafters.pld import PromptLookupDrafter
from dartspec.runtime import FeatureSource
from dartspec.tree import Tree

#: Distinct lookup continuations per step (the development answers: 3 a little above 1 at 4, 16 and 32 nodes).
LOOKUP_MATCHES = 3


class HybridDrafter(DrafterBase):
    """Merges a :class:`PromptLookupDrafter`'s paths (first) with another drafter's tree, in the engine's budget
    (named after it: ``dart+pld``, ``draft-model+pld``)."""

    def __init__(
        self,
        drafter: Drafter,
        lookup: PromptLookupDrafter | None = None,
        draft_nodes: int | None = None,
        draft_context: int | None = None,
        beside_spans: bool = True,
    ) -> None:
        """``draft_nodes``: at most this many nodes (root included) of the budget go to ``drafter``'s tree; None:
        all that the lookup's spans leave. ``draft_context``: ``drafter`` drafts only while the context (prompt and
        answer so far) is at most this many tokens, then the lookup alone; None: always. ``beside_spans`` False:
        where the lookup finds spans they are the whole tree, and ``drafter`` drafts only where it finds none (for
        a drafter whose forwards cost a good part of a target step, such as a draft model)."""
        if draft_nodes is not None and draft_nodes < 1:
            raise ValueError(f"draft_nodes must be >= 1 (got {draft_nodes})")
        if draft_context is not None and draft_context < 1:
            raise ValueError(f"draft_context must be >= 1 (got {draft_context})")
        self.drafter = drafter
        self.name = f"{drafter.name}+pld"  # dart+pld, draft-model+pld
        self.lookup = lookup or PromptLookupDrafter(max_matches=LOOKUP_MATCHES)
        self.draft_nodes = draft_nodes
        self.draft_context = draft_context
        self.beside_spans = beside_spans
        self.needs_features = drafter.needs_features
        self._lookup_only: int | None = None  # the context at which this sequence's drafter stopped

    def _past(self, length: int) -> bool:
        if self._lookup_only is None and self.draft_context is not None and length > self.draft_context:
            self._lookup_only = length
        return self._lookup_only is not None

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._lookup_only = None
        self._past(len(prompt_ids))  # a prompt longer than draft_context: lookup alone from the start
        self.lookup.begin(prompt_ids)
        self.drafter.begin(prompt_ids)

    def observe(self, token_ids: Sequence[int], features: torch.Tensor | None) -> None:
        if self._lookup_only is None:  # once stopped, the drafter never reads the features it would queue
            self.drafter.observe(token_ids, features)

    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        if self._past(len(tokens)):
            self.last_tree_seconds = 0.0
            return hybrid_tree(self.lookup, tokens, budget, lambda room: Tree.root_only(tokens[-1]), 1)
        tree = hybrid_tree(
            self.lookup,
            tokens,
            budget,
            lambda room: self.drafter.propose(tokens, room),
            self.draft_nodes,
            self.beside_spans,
        )
        self.last_tree_seconds = self.drafter.last_tree_seconds
        return tree

    def report(self) -> dict:
        report = dict(self.drafter.report())
        if self._lookup_only is not None:
            report["lookup_only_from"] = self._lookup_only  # the context at which the network stopped drafting
        return report

    def _own_state(self) -> None:
        self.drafter = self.drafter.fork()
        self.lookup = self.lookup.fork()  # stateless unless gated: a gate learns per sequence


def hybrid_tree(
    lookup: PromptLookupDrafter,
    tokens: Sequence[int],
    budget: DraftBudget,
    draft: Callable[[DraftBudget], Tree],
    draft_nodes: int | None = None,
    beside_spans: bool = True,
) -> Tree:
    """``lookup``'s continuations of ``tokens`` first, then the tree ``draft`` makes in the nodes they leave (all of
    them without a match; none where there are spans and not ``beside_spans``), at most ``draft_nodes`` of them, less
    what a batched step cut (``budget.batch_cut``).
    Where the spans fill the budget, ``draft`` gets one node (the root: a network drafter then runs nothing, and its
    committed features wait for its next step, which absorbs them in one forward)."""
    root = tokens[-1]
    cap = budget.max_nodes
    if draft_nodes is not None:
        cap = max(1, min(draft_nodes - budget.batch_cut, budget.max_nodes))
    spans = lookup.spans(tokens, budget)
    if not spans:
        return draft(replace(budget, max_nodes=cap, batch_cut=0))
    copied = Tree.from_paths(root, spans, max_nodes=budget.max_nodes)
    if not beside_spans:
        return copied
    room = budget.max_nodes - copied.size + 1  # the drafter's tree shares the root
    tree = draft(replace(budget, max_nodes=max(min(room, cap), 1), batch_cut=0, beside=copied.size - 1))
    if tree.size == 1:
        return copied
    if tree.proposals:  # a sampled tree keeps its nodes and proposals: the spans join as fixed guesses after them
        return tree.with_paths(spans, budget.max_nodes)
    guesses = [tree.tokens[path[1:]].tolist() for path in tree.paths()]
    return Tree.from_paths(root, [*spans, *guesses], max_nodes=budget.max_nodes)


def build(target: FeatureSource, options: DrafterOptions) -> HybridDrafter:
    """The registry's builder of ``dart+pld``: lookup spans plus a DART tree in the nodes they leave. With
    ``--tree-size auto`` (``options.auto_size``) the budget is the sizer's ceiling and its cost model cuts only the
    DART tree, so the lookup proposes one continuation (at most ``max_depth`` nodes), not three.
    ``options.draft_nodes`` caps the DART tree's share of the budget, ``options.draft_context`` the context DART
    drafts in."""
    from dartspec.drafters import dart

    matches = 1 if options.auto_size else LOOKUP_MATCHES
    lookup = PromptLookupDrafter(max_matches=matches)
    return HybridDrafter(dart.build(target, options), lookup, options.draft_nodes, options.draft_context)


def build_draft_model(target: Any, options: DrafterOptions) -> HybridDrafter:
    """The registry's builder of ``draft-model+pld``: prompt lookup's spans where the context has a match, else a
    draft model's chain (a step with spans runs no draft forward; the next proposal feeds what the draft model missed
    in one forward). ``options.draft_nodes`` caps the chain's share of the budget (``--draft-nodes``).
    Qwen2.5-Coder-1.5B with 0.5B drafting (8 prompts a set, 2-core Intel Xeon): 1.94x plain decoding on HumanEval
    (prompt lookup alone 1.98x, the draft model alone 1.40x), 1.09x on MT-Bench (0.99x, 1.07x); the draft model
    filling the nodes spans left ran 1.88x on HumanEval (BENCHMARKS.md, "Draft models")."""
    from dartspec.drafters import draft_model

    lookup = PromptLookupDrafter(max_matches=LOOKUP_MATCHES)
    drafter = draft_model.build(target, options)
    return HybridDrafter(drafter, lookup, options.draft_nodes, options.draft_context, beside_spans=False)
