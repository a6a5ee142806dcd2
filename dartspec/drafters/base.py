"""The drafter interface: propose a tree from the current state, observe what was committed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from dartspec.tree import Tree


@dataclass(frozen=True)
class DraftBudget:
    """Limits for one proposal: total tree nodes (root included) and depth below the root."""

    max_nodes: int
    max_depth: int


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
