"""The EAGLE-3 baseline drafter: autoregressive drafting with EAGLE-2's dynamic tree.

Per step: one forward over the newly committed positions (features from the verification pass) gives
the depth-1 distribution; then, level by level, the ``topk`` nodes of the newest level with the best
path log-probability are run through the drafter together (one forward per level, tree attention
over the committed cache and their ancestors) and each proposes its ``topk`` best children. The tree
is the best ``max_nodes - 1`` nodes by path log-probability (prefix-closed, since a child never scores
above its parent). Expansion stops early once no frontier node can still enter the kept set.

Costs one drafter forward per depth where DART pays one in total: the comparison the paper makes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from dartspec.drafters.base import DraftBudget, FeatureDrafter
from dartspec.drafters.dart_fast import FastDraftNet
from dartspec.drafters.dart_model import DraftKV
from dartspec.drafters.eagle3_model import Eagle3Model
from dartspec.drafters.options import DrafterOptions, checkpoint_folder
from dartspec.errors import DartspecError
from dartspec.runtime import FeatureSource
from dartspec.tree import Tree
from dartspec.tree_size import AutoSizer, auto_sizer


class Eagle3Drafter(FeatureDrafter):
    """EAGLE-3 as a :class:`~dartspec.drafters.base.Drafter`."""

    name = "eagle3"

    def __init__(
        self,
        model: Eagle3Model,
        target: FeatureSource,
        *,
        topk: int = 4,
        auto_size: AutoSizer | None = None,
        fast_step: bool | None = None,
    ) -> None:
        """Args:
        model: the trained network (its ``cfg.depth`` bounds the tree depth it drafts).
        target: the target it was trained for (checked).
        topk: nodes expanded per level and children proposed per expanded node (EAGLE-2's k).
        auto_size: cut each tree to the size with the best expected tokens per second, estimating a
            node's acceptance by its path probability (:mod:`dartspec.tree_size`).
        """
        if topk < 1:
            raise DartspecError("eagle3 topk must be >= 1")
        super().__init__(model, target, auto_size)
        # On a float32 CPU target the network runs on dartspec's C kernels, as DART's does (dart_fast.py).
        fast = FastDraftNet.supports(model, target.device, target.dtype) if fast_step is None else fast_step
        self._fast = FastDraftNet(self.model) if fast else None
        self.topk = topk
        self.eos = set(int(t) for t in target.eos_token_ids)
        self._level_s = 0.0  # running time of one tree level's drafter forward (for auto_size)
        self._committed = 0  # real positions in the C path's draft cache (its tree nodes follow them)

    @classmethod
    def from_pretrained(cls, folder: str | Path, target: FeatureSource, **kw) -> Eagle3Drafter:
        return cls(Eagle3Model.load(folder, device=target.device, dtype=target.dtype), target, **kw)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        super().begin(prompt_ids)
        if self._fast is not None:
            self._fast.reset()

    def _own_state(self) -> None:
        super()._own_state()
        if self._fast is not None:
            self._fast = self._fast.fork()

    def _context_step(self, feats: torch.Tensor, embeds: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed positions into the draft cache: depth-1 log-probs and the last residual (as context_step)."""
        if self._fast is None:
            return self.model.context_step(feats, embeds, start, self._cache)
        net = self._fast
        net.cache.truncate(start)  # the last tree's nodes followed the committed positions: not context
        if net.cache.length != start:
            raise RuntimeError(f"draft cache out of step: {net.cache.length} cached, step starts at {start}")
        h = net.features(feats)
        out = net.run(net.inputs(h, embeds), h, torch.arange(start, start + feats.shape[0]), None)
        self._committed = start + feats.shape[0]
        return net.logprobs(out[-1:])[0], out[-1].clone()

    def _tree_step(
        self, parents: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, tree: DraftKV
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One tree level (as tree_step): ``mask`` ``(n, T + n)`` over the earlier tree nodes and these."""
        if self._fast is None:
            return self.model.tree_step(parents, embeds, positions, mask, self._cache, tree)
        net = self._fast
        # The C block's mask covers the whole cache: committed positions (all visible), then the tree nodes.
        full = torch.cat([torch.ones(mask.shape[0], self._committed, dtype=torch.bool), mask.cpu()], dim=1)
        out = net.run(net.inputs(parents, embeds), parents.clone(), positions.cpu(), full.contiguous())
        return net.logprobs(out), out

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        root = int(tokens[-1])
        t_draft = time.perf_counter()
        self.last_tree_seconds = 0.0
        self._proposed = None
        # No room to draft: the committed features wait for the next step that drafts (as in DART).
        waiting = self._queue.take(tokens) if budget.max_depth > 0 and budget.max_nodes > 1 else None
        if waiting is None:
            return Tree.root_only(root)
        feats, start, next_ids = waiting
        logp0, h0 = self._context_step(feats, self.embed(next_ids), start)
        keep = budget.max_nodes - 1
        max_depth = min(budget.max_depth, keep, self.model.cfg.depth)
        if keep < 1 or max_depth < 1:
            return Tree.root_only(root)
        k = min(self.topk, keep)
        base = len(tokens) - 2  # draft position of the root's row; a node at depth d sits at base + d

        # Candidate nodes, in creation order (parents first): target token, parent (-1 = root), path log-prob.
        tok: list[int] = []
        parent: list[int] = []
        score: list[float] = []
        slot: dict[int, int] = {}  # candidate -> its entry in the tree KV (expanded nodes only)
        hidden: dict[int, torch.Tensor] = {}  # candidate -> its residual output (expanded nodes only)
        tree_kv = DraftKV()

        def add_children(logp: torch.Tensor, parents: list[int], base_scores: list[float]) -> list[int]:
            vals, ids = logp.topk(k, dim=-1)
            vals, ids = vals.float().cpu().numpy(), ids.cpu().numpy()
            new = []
            for row, p in enumerate(parents):
                for v, i in zip(vals[row], ids[row], strict=True):
                    new.append(len(tok))
                    tok.append(int(self.d2t[i]))
                    parent.append(p)
                    score.append(base_scores[row] + float(v))
            return new

        level = add_children(logp0[None], [-1], [0.0])
        for depth in range(2, max_depth + 1):
            # Expand the best k nodes of the newest level; EOS ends a path.
            frontier = sorted((c for c in level if tok[c] not in self.eos), key=lambda c: -score[c])[:k]
            if not frontier:
                break
            if len(score) >= keep:
                # Children score below their parents: stop when none could displace the keep-th best node.
                cutoff = np.partition(-np.asarray(score), keep - 1)[keep - 1]
                if -score[frontier[0]] >= cutoff:
                    break
            if self.auto is not None and not self.auto.worth_growing(
                np.exp([0.0, *score]), float(np.exp(score[frontier[0]])), len(frontier) * k, self._level_s
            ):
                break  # no child could pay for another drafter forward plus its verification
            t_level = time.perf_counter()
            prev = [hidden[parent[c]] if parent[c] >= 0 else h0 for c in frontier]
            ids = torch.tensor([tok[c] for c in frontier], device=h0.device)
            positions = torch.full((len(frontier),), base + depth - 1, device=h0.device)
            n_old = len(slot)
            mask = torch.zeros(len(frontier), n_old + len(frontier), dtype=torch.bool, device=h0.device)
            for row, c in enumerate(frontier):
                a = parent[c]
                while a >= 0:
                    mask[row, slot[a]] = True
                    a = parent[a]
                mask[row, n_old + row] = True
            logp, out = self._tree_step(torch.stack(prev), self.embed(ids), positions, mask, tree_kv)
            for row, c in enumerate(frontier):
                slot[c] = n_old + row
                hidden[c] = out[row]
            level = add_children(logp, frontier, [score[c] for c in frontier])
            spent = time.perf_counter() - t_level
            self._level_s = spent if not self._level_s else 0.9 * self._level_s + 0.1 * spent

        t0 = time.perf_counter()
        # Best `keep` by path log-prob; ties go to the earlier node, so parents always come before children.
        order = sorted(range(len(score)), key=lambda c: (-score[c], c))[:keep]
        kept = sorted(order)
        tree = Tree.from_nodes(root, tok, parent, kept)
        if self.auto is not None:
            # Path probabilities are EAGLE's own acceptance estimates; the sizer rescales them as it learns.
            estimates = np.exp(np.array([0.0] + [score[c] for c in kept]))
            tree = self.auto.cut(tree, estimates, time.perf_counter() - t_draft)
            self._proposed = tree
        self.last_tree_seconds = time.perf_counter() - t0
        return tree


def build(target: FeatureSource, options: DrafterOptions) -> Eagle3Drafter:
    """The registry's builder of ``eagle3``: ``options.checkpoint`` or the shipped one, ``options.topk`` nodes
    expanded per level (``auto_size`` cuts the tree by path probability, as for ``dart``)."""
    folder = checkpoint_folder("eagle3", target, options.checkpoint, "EAGLE-3")
    return Eagle3Drafter.from_pretrained(
        folder, target, topk=options.topk, auto_size=auto_sizer(target, options.auto_size)
    )
