"""The DART drafter: one forward of :class:`DartModel` per step, then a tree built from its d rows.

Drafting is incremental: the draft KV cache holds committed positions only, and each step feeds just
the positions the target committed since the last step (with the hidden features the verification
pass already computed, never an extra target forward) plus the d-1 mask slots.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from dartspec.drafters.base import DraftBudget
from dartspec.drafters.dart_model import DartModel, DraftKV
from dartspec.errors import DartspecError
from dartspec.tree import Tree

#: Builds a tree from (root, log-probs (d, Vd), d2t, committed tokens, budget).
TreeBuilder = Callable[[int, torch.Tensor, np.ndarray, Sequence[int], DraftBudget], Tree]


def chain_builder(root: int, logp: torch.Tensor, d2t: np.ndarray, tokens: Sequence[int], budget: DraftBudget) -> Tree:
    """Top-1 token per depth: a single path."""
    depth = min(logp.shape[0], budget.max_depth, budget.max_nodes - 1)
    if depth <= 0:
        return Tree.root_only(root)
    best = logp[:depth].argmax(-1).cpu().numpy()
    return Tree.chain(root, d2t[best].tolist())


class DartDrafter:
    """DART as a :class:`~dartspec.drafters.base.Drafter`."""

    name = "dart"
    needs_features = True

    def __init__(self, model: DartModel, target, tree_builder: TreeBuilder = chain_builder) -> None:
        model.check_target(target)
        self.model = model.to(target.device).eval()
        self.target = target
        self.embed = target.model.get_input_embeddings()
        self.tree_builder = tree_builder
        self.d2t = model.d2t.cpu().numpy()
        self.last_tree_seconds = 0.0
        self._cache = DraftKV()
        self._pending: list[torch.Tensor] = []
        self._committed = 0  # real positions already in the draft cache

    @classmethod
    def from_pretrained(cls, folder: str | Path, target, tree_builder: TreeBuilder = chain_builder) -> DartDrafter:
        model = DartModel.load(folder, device=target.device, dtype=target.dtype)
        return cls(model, target, tree_builder)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._cache = DraftKV()
        self._pending = []
        self._committed = 0

    def observe(self, token_ids: Sequence[int], features: torch.Tensor | None) -> None:
        if features is None:
            raise DartspecError("the DART drafter needs target features (Target.verify(..., features=True))")
        self._pending.append(features)

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        root = int(tokens[-1])
        start = self._committed
        if self._pending:
            feats = torch.cat(self._pending)
            self._pending = []
        else:
            feats = None
        if feats is None or budget.max_depth == 0 or budget.max_nodes <= 1:
            # Nothing to draft (or no room): still absorb the features so the cache stays in step.
            if feats is not None:
                self._absorb(feats, tokens, start)
            self.last_tree_seconds = 0.0
            return Tree.root_only(root)
        m = feats.shape[0]
        if start + m + 1 != len(tokens):
            raise RuntimeError(f"DART drafter out of step: {start} cached + {m} new + root != {len(tokens)} tokens")
        next_ids = torch.tensor(tokens[start + 1 : start + m + 1], device=feats.device)
        logp = self.model.step(feats, self.embed(next_ids), start, self._cache, depth=budget.max_depth)
        self._committed = start + m
        t0 = time.perf_counter()
        tree = self.tree_builder(root, logp, self.d2t, tokens, budget)
        self.last_tree_seconds = time.perf_counter() - t0
        return tree

    def _absorb(self, feats: torch.Tensor, tokens: Sequence[int], start: int) -> None:
        m = feats.shape[0]
        next_ids = torch.tensor(tokens[start + 1 : start + m + 1], device=feats.device)
        self.model.step(feats, self.embed(next_ids), start, self._cache, depth=1)
        self._committed = start + m
