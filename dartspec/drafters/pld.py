"""Prompt lookup decoding: propose what followed earlier occurrences of the current suffix.

No model: the last n tokens (n from ``max_ngram`` down to ``min_ngram``) are searched for earlier in
the context, and the tokens that followed the most recent matches become the draft. One match gives
a chain; several distinct continuations are merged into a small tree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dartspec.drafters.base import DraftBudget, DrafterBase
from dartspec.tree import Tree


class PromptLookupDrafter(DrafterBase):
    """Prompt lookup (PLD) as a tree drafter."""

    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, max_matches: int = 3) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches

    def continuations(self, tokens: Sequence[int], length: int) -> list[list[int]]:
        """Up to ``max_matches`` distinct continuations of the longest matching suffix, newest first."""
        seq = np.asarray(tokens, dtype=np.int64)
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
        """:meth:`continuations` as deep as ``budget`` allows; none without room beside the root (a full batch's
        share), where the search, a scan of the whole context, is skipped."""
        return self.continuations(tokens, budget.max_depth) if budget.max_depth > 0 and budget.max_nodes > 1 else []

    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        return Tree.from_paths(tokens[-1], self.spans(tokens, budget), max_nodes=budget.max_nodes)


def build(target: object, options: object) -> PromptLookupDrafter:
    """The registry's builder of ``pld``."""
    return PromptLookupDrafter()
