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

from dartspec.drafters.base import DraftBudget, FeatureDrafter
from dartspec.drafters.dart_fast import FastDraftNet
from dartspec.drafters.dart_graphs import GraphDraftNet
from dartspec.drafters.dart_model import DartModel
from dartspec.drafters.options import DrafterOptions, checkpoint_folder
from dartspec.ngram import MergedNgram, NgramModel, OnlineNgram
from dartspec.runtime import FeatureSource
from dartspec.search import make_tree_builder, sampled_tree
from dartspec.tree import Tree
from dartspec.tree_size import AutoSizer, auto_sizer, node_estimates

#: Builds a tree from (root, log-probs (d, Vd), d2t, committed tokens, budget); see :mod:`dartspec.search`.
TreeBuilder = Callable[[int, torch.Tensor, np.ndarray, Sequence[int], DraftBudget], Tree]


class DartDrafter(FeatureDrafter):
    """DART as a :class:`~dartspec.drafters.base.Drafter`."""

    name = "dart"

    def __init__(
        self,
        model: DartModel,
        target: FeatureSource,
        tree: str | TreeBuilder = "chain",
        *,
        ngram: NgramModel | None = None,
        online_ngram: bool = False,
        auto_size: AutoSizer | None = None,
        fast_step: bool | None = None,
    ) -> None:
        """Args:
        model: the trained network.
        target: the target it was trained for (checked).
        tree: ``chain``, ``beam`` (DART's n-gram-guided search), ``ddtree`` or a builder callable.
        ngram: a static n-gram model for the beam search.
        online_ngram: also score with counts from the current prompt and output.
        auto_size: cut each tree to the size with the best expected tokens per second
            (:mod:`dartspec.tree_size`); the engine's budget is then the largest size considered.
        fast_step: run the network on the C kernels (:mod:`dartspec.drafters.dart_fast`); None: where supported.
        """
        super().__init__(model, target, auto_size)
        self._tree, self._ngram = tree, ngram
        self.online = OnlineNgram(ngram.order if ngram is not None else 3) if online_ngram else None
        self.tree_builder = self._tree_builder()
        self.t2d = np.full(max(int(self.d2t.max()) + 1, 1), -1, dtype=np.int64)
        self.t2d[self.d2t] = np.arange(len(self.d2t))
        # Where the network's step runs other than in torch, with a draft cache of its own: on a float32 CPU target
        # dartspec's C kernels (8-bit weight groups; dart_fast.py), with a target on CUDA graphs graphs of its own
        # (dart_graphs.py).
        fast = FastDraftNet.supports(model, target.device, target.dtype) if fast_step is None else fast_step
        self._net: FastDraftNet | GraphDraftNet | None = FastDraftNet(self.model) if fast else None
        if self._net is None and type(model) is DartModel and getattr(target, "step_graphs", None) is not None:
            self._net = GraphDraftNet(model, capture=target.device.type == "cuda")

    def _tree_builder(self) -> TreeBuilder:
        """The tree builder, scoring with the static and this sequence's online n-grams."""
        if not isinstance(self._tree, str):
            return self._tree
        online, static = self.online, self._ngram
        scorer = MergedNgram(static, online) if (static is not None or online is not None) else None
        return make_tree_builder(self._tree, ngram=scorer, eos_ids=sorted(self.target.eos_token_ids))

    def _own_state(self) -> None:
        super()._own_state()
        if self.online is not None:
            self.online = OnlineNgram(self.online.order)
            self.tree_builder = self._tree_builder()
        if self._net is not None:
            self._net = self._net.fork()

    #: The network class this drafter runs (a subclass drafts with another parallel network the same way).
    model_cls: type[DartModel] = DartModel

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, target: FeatureSource, tree: str | TreeBuilder = "chain", **kw
    ) -> DartDrafter:
        model = cls.model_cls.load(folder, device=target.device, dtype=target.dtype, target=target)
        return cls(model, target, tree, **kw)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        super().begin(prompt_ids)
        if self.online is not None:
            self.online.reset()
        if self._net is not None:
            self._net.reset()

    def _step(self, feats: torch.Tensor, next_ids: torch.Tensor, start: int, depth: int) -> torch.Tensor:
        if self._net is not None:
            return self._net.dart_step(feats, self.embed(next_ids), start, depth)
        return self.model.step(feats, self.embed(next_ids), start, self._cache, depth=depth)

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        root = int(tokens[-1])
        t_draft = time.perf_counter()
        self.last_tree_seconds = 0.0
        self._proposed = None  # a step that drafts nothing teaches the tree sizer nothing
        # No room to draft: the committed features wait in the queue for the next step that drafts (a full batch
        # gives each sequence one row; absorbing what it committed meanwhile then costs one forward, not one a step).
        waiting = self._queue.take(tokens) if budget.max_depth > 0 and budget.max_nodes > 1 else None
        if waiting is None:
            return Tree.root_only(root)
        feats, start, next_ids = waiting
        if self.auto is not None and budget.sampling is None:  # no deeper or bigger than the sizer has been cutting
            budget = self.auto.draft_budget(budget)
        # A tree of R nodes reaches depth R-1 at most: rows beyond that are never used.
        depth = min(budget.max_depth, budget.max_nodes - 1)
        logp = self._step(feats, next_ids, start, depth)
        t0 = time.perf_counter()
        if self.online is not None:
            self.online.extend(tokens[len(self.online.history) :])
        if budget.sampling is not None:  # a drawn token tested by rejection in the searched tree; no cut
            tree = sampled_tree(self.tree_builder, root, logp, self.d2t, tokens, budget)
        else:
            tree = self.tree_builder(root, logp, self.d2t, tokens, budget)
            if self.auto is not None:
                estimates = node_estimates(tree, logp, self.t2d)
                tree = self.auto.cut(tree, estimates, time.perf_counter() - t_draft, beside=budget.beside)
        self._proposed = tree
        self.last_tree_seconds = time.perf_counter() - t0
        return tree


def build(target: FeatureSource, options: DrafterOptions) -> DartDrafter:
    """The registry's builder of ``dart``: ``options.checkpoint`` or the shipped drafter; ``tree`` picks the builder
    (beam, ddtree, chain), ``ngram`` a static n-gram file (default: the one shipped next to the drafter, if any;
    ``"off"`` for none), ``online_ngram`` adds prompt/output n-grams, ``ngram_smoothing`` (0 < s < 1) scores with
    the interpolated n-gram instead of DART's longest-context rule, ``auto_size`` cuts each tree to the size with
    the best expected tokens/s on this machine (:mod:`dartspec.tree_size`)."""
    return build_parallel(DartDrafter, "dart", "DART", target, options)


def build_parallel(
    cls: type[DartDrafter], kind: str, label: str, target: FeatureSource, options: DrafterOptions
) -> DartDrafter:
    """A drafter of ``cls`` (DART's propose over another parallel network) from ``options`` (see :func:`build`)."""
    from dartspec.ngram import SmoothedNgram, tokenizer_identity

    folder = checkpoint_folder(kind, target, options.checkpoint, label)
    if options.ngram == "off":
        ngram_path = None
    elif options.ngram:
        ngram_path = Path(options.ngram)
    else:
        ngram_path = folder / "ngram.bin" if (folder / "ngram.bin").is_file() else None
    static = None
    if ngram_path:
        identity = tokenizer_identity(target.tokenizer, getattr(target, "vocab", None))
        static = NgramModel.load(ngram_path, tokenizer=identity)
    if static is not None and options.ngram_smoothing:
        static = SmoothedNgram(static, options.ngram_smoothing)
    return cls.from_pretrained(
        folder,
        target,
        options.tree,
        ngram=static,
        online_ngram=options.online_ngram,
        auto_size=auto_sizer(target, options.auto_size),
    )
