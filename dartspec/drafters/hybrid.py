"""DART plus prompt lookup in one tree: copied spans as extra branches.

Prompt lookup is nearly free and very precise when the answer repeats the prompt (code, extraction),
and it proposes nothing otherwise; the DART drafter guesses everywhere but rarely far. The hybrid
verifies both at once: the lookup continuations (when the context has a match) and the DART tree
(sized as for DART alone) are merged into one prefix tree, so a step costs T(DART nodes) without a
match and T(DART nodes + span) with one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dartspec.drafters.base import DraftBudget, Drafter, DrafterBase
from dartspec.drafters.options import DrafterOptions
from dartspec.drafters.pld import PromptLookupDrafter
from dartspec.runtime import FeatureSource
from dartspec.tree import Tree


class HybridDrafter(DrafterBase):
    """Merges a :class:`PromptLookupDrafter`'s paths (first) with another drafter's tree."""

    name = "dart+pld"
    needs_features = True

    def __init__(self, drafter: Drafter, lookup: PromptLookupDrafter | None = None, *, drafter_nodes: int = 4):
        """``drafter_nodes``: the tree size given to ``drafter`` (root included); the engine's budget caps the merge."""
        self.drafter = drafter
        self.lookup = lookup or PromptLookupDrafter(max_matches=1)
        self.drafter_nodes = drafter_nodes
        self.needs_features = drafter.needs_features

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.drafter.begin(prompt_ids)
        self.lookup.begin(prompt_ids)

    def observe(self, token_ids: Sequence[int], features: torch.Tensor | None) -> None:
        self.drafter.observe(token_ids, features)

    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        inner = DraftBudget(max_nodes=min(self.drafter_nodes, budget.max_nodes), max_depth=budget.max_depth)
        tree = self.drafter.propose(tokens, inner)
        self.last_tree_seconds = self.drafter.last_tree_seconds
        spans = self.lookup.continuations(tokens, budget.max_depth) if budget.max_depth > 0 else []
        if not spans:
            return tree
        # Lookup spans go first: when the budget cuts, a long exact copy is worth more than a guess.
        guesses = [tree.tokens[path[1:]].tolist() for path in tree.paths()]
        # With a span the tree is already long: keep only the best DART guesses (half its nodes), since
        # on a CPU every extra node makes the verification dearer.
        span_nodes = len(Tree.from_paths(tokens[-1], spans).tokens) - 1
        cap = 1 + span_nodes + max(1, (self.drafter_nodes - 1) // 2)
        return Tree.from_paths(tokens[-1], [*spans, *guesses], max_nodes=min(budget.max_nodes, cap))

    def report(self) -> dict:
        return self.drafter.report()

    def _own_state(self) -> None:
        self.drafter = self.drafter.fork()  # the lookup has no state


def build(target: FeatureSource, options: DrafterOptions) -> HybridDrafter:
    """The registry's builder of ``dart+pld``: a DART tree of ``options.drafter_nodes`` nodes plus lookup spans."""
    from dartspec.drafters import dart

    return HybridDrafter(dart.build(target, options), drafter_nodes=options.drafter_nodes)
