"""The drafter interface: propose a tree from the current state, observe what was committed.

The contract is :class:`Drafter`; :class:`DrafterBase` gives its optional parts their defaults (nothing to set up
or observe, no report, no separate tree-building time), so a new drafter writes ``propose`` and what differs.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

import torch

from dartspec.drafters.dart_model import DraftKV
from dartspec.errors import DartspecError
from dartspec.quant import use_fast_linears
from dartspec.tree import DraftBudget, Tree

if TYPE_CHECKING:
    from torch import nn

    from dartspec.runtime import FeatureSource
    from dartspec.tree_size import AutoSizer

__all__ = ["DraftBudget", "Drafter", "DrafterBase", "FeatureDrafter", "FeatureQueue", "NoDrafter"]


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
    #: Seconds of the last :meth:`propose` spent building the tree from the network's output (the engine reports
    #: drafting and tree building apart); 0 where there is no such split.
    last_tree_seconds: float

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Start a new sequence."""
        ...

    def observe(self, token_ids: Sequence[int], features: torch.Tensor | None) -> None:
        """``token_ids`` are now in the target's cache; ``features`` is ``(len, F*H)`` or None."""
        ...

    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        """A tree rooted at ``tokens[-1]`` (all committed tokens so far), within ``budget``."""
        ...

    def report(self) -> dict:
        """Drafter-specific figures for a finished generation (merged into its stats)."""
        ...

    def fork(self) -> Drafter:
        """A drafter for another sequence stepped beside this one (continuous batching): the same networks and
        settings, its own per-sequence state."""
        ...


class DrafterBase:
    """The defaults of the :class:`Drafter` contract; subclasses write :meth:`propose`."""

    name = "base"
    needs_features = False
    last_tree_seconds = 0.0

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Start a new sequence (nothing to reset by default)."""

    def observe(self, token_ids: Sequence[int], features: torch.Tensor | None) -> None:
        """Committed tokens (ignored by default)."""

    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        raise NotImplementedError

    def report(self) -> dict:
        return {}

    def fork(self) -> Self:
        twin = copy.copy(self)  # networks and settings are shared, never written while drafting
        twin._own_state()
        return twin

    def _own_state(self) -> None:
        """Replace, in a fresh shallow copy, every mutable per-sequence object it would share with the original
        (nothing by default: a drafter without state, such as prompt lookup, is a function of the tokens)."""


class NoDrafter(DrafterBase):
    """Plain autoregressive decoding: the tree is the root alone (q = 1)."""

    name = "none"

    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        return Tree.root_only(tokens[-1])


def build_none(target: object, options: object) -> NoDrafter:
    """The registry's builder of ``none`` (plain decoding)."""
    return NoDrafter()


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


class FeatureDrafter(DrafterBase):
    """What DART and EAGLE-3 share: a network over the target's features, fed incrementally.

    Per generation the target is switched to the network's feature layers (before the prefill), the draft KV
    cache and the feature queue start empty; each verification's committed features wait in the queue for the
    next :meth:`propose`, and an automatic tree sizer (optional) learns from how many drafts were accepted.
    """

    needs_features = True

    def __init__(self, model: nn.Module, target: FeatureSource, auto_size: AutoSizer | None) -> None:
        model.check_target(target)
        self.model = model.to(target.device).eval()
        self.feature_dtype = self.model.fc.weight.dtype  # the network's: what observe casts features to
        use_fast_linears(self.model, target)
        self.target = target
        self.embed = target.embed
        self.d2t = model.d2t.cpu().numpy()
        self.auto = auto_size
        #: the tree the last propose drafted, whose outcome the sizer learns from (None: it drafted nothing)
        self._proposed: Tree | None = None
        self._cache = DraftKV()
        self._queue = FeatureQueue()

    def _own_state(self) -> None:
        self._cache = DraftKV()
        self._queue = FeatureQueue()
        self._proposed = None
        if self.auto is not None:  # the learned calibration carries over, the size history does not
            self.auto = dataclasses.replace(self.auto, chosen=[], depths=[])

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.target.set_feature_layers(self.model.cfg.feature_layers)
        self._cache = DraftKV()
        self._queue.reset()
        self._proposed = None
        if self.auto is not None:
            self.auto.begin()

    def observe(self, token_ids: Sequence[int], features: torch.Tensor | None) -> None:
        # In the network's dtype: a CPU target loaded in 16 bits hands over its kernels' fp32 features (a no-op
        # where the two agree)
        self._queue.push(None if features is None else features.to(self.feature_dtype), self.name)
        if self.auto is not None and self._proposed is not None:
            # the accepted drafts that were this drafter's own: beside lookup spans (dart+pld) the path may leave its
            # tree, and the spans' tokens must not count as its estimates coming true
            self.auto.observe(self._proposed.matched_depth(token_ids[1:]))

    def report(self) -> dict:
        """Extra ``--json`` figures: the automatic tree size's choices and why."""
        return {"tree_size_auto": self.auto.report()} if self.auto is not None else {}
