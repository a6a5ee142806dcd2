"""The drafter interface: propose a tree from the current state, observe what was committed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from dartspec.errors import DartspecError
from dartspec.tree import DraftBudget, Tree

__all__ = ["DraftBudget", "Drafter", "FeatureQueue", "NoDrafter"]


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes draft trees for the engine.

    Lifecycle per generation: :meth:`begin` once, then for every target forward :meth:`observe`
    with the tokens that just entered the target's KV cache (the prompt after prefill, the accepted
    path after each verification) and their hidden features, and :meth:`propose` before each
    verification.
    """

    name: str
    #: Whether :meth:`observe` needs the target's hidden features (costs a little memory traffic).
    needs_features: bool

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Start a new sequence."""
        ...

    def observe(self, token_ids: Sequence[int], features: torch.Tensor | None) -> None:
        """``token_ids`` are now in the target's cache; ``features`` is ``(len, F*H)`` or None."""
        ...

    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        """A tree rooted at ``tokens[-1]`` (all committed tokens so far), within ``budget``."""
        ...


class NoDrafter:
    """Plain autoregressive decoding: the tree is the root alone (q = 1)."""

    name = "none"
    needs_features = False

    def begin(self, prompt_ids: Sequence[int]) -> None:
        pass

    def observe(self, token_ids: Sequence[int], features: torch.Tensor | None) -> None:
        pass

    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        return Tree.root_only(tokens[-1])


class FeatureQueue:
    """Target features of committed positions that a feature-based drafter has not yet fed to its cache.

    Real position j pairs the target's features at j with token j+1, so after each verification the
    newest committed token (the next tree's root) waits one step for its features.
    """

    def __init__(self) -> None:
        self.pending: list[torch.Tensor] = []
        self.committed = 0  # real positions already in the drafter's cache

    def reset(self) -> None:
        self.pending = []
        self.committed = 0

    def push(self, features: torch.Tensor | None, drafter: str) -> None:
        if features is None:
            raise DartspecError(f"the {drafter} drafter needs target features (Target.verify(..., features=True))")
        self.pending.append(features)

    def take(self, tokens: Sequence[int]) -> tuple[torch.Tensor, int, torch.Tensor] | None:
        """``(features (m, F*H), start position, ids of tokens start+1..start+m)`` of the waiting positions."""
        if not self.pending:
            return None
        feats = torch.cat(self.pending)
        self.pending = []
        start, m = self.committed, feats.shape[0]
        if start + m + 1 != len(tokens):
            raise RuntimeError(f"drafter out of step: {start} cached + {m} new + root != {len(tokens)} tokens")
        self.committed = start + m
        return feats, start, torch.tensor(tokens[start + 1 : start + m + 1], device=feats.device)
