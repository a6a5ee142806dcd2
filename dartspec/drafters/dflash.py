"""DFlash as a :class:`~dartspec.drafters.base.Drafter`: DART's drafting loop (feature queue, draft cache, trees by
the beam search or DDTree over the per-depth rows, n-grams, ``--tree-size auto``) over the DFlash network
(:mod:`dartspec.drafters.dflash_model`). The proposal is the tree of the rows' top tokens, so verification stays
exact as for every drafter."""

from __future__ import annotations

from typing import Any

from dartspec.drafters.dart import DartDrafter, build_parallel
from dartspec.drafters.dflash_model import DFlashModel
from dartspec.drafters.options import DrafterOptions
from dartspec.runtime import FeatureSource


class DFlashDrafter(DartDrafter):
    """DFlash's block drafter behind DART's propose."""

    name = "dflash"
    model_cls = DFlashModel

    def __init__(self, model: DFlashModel, target: FeatureSource, tree: Any = "beam", **kw: Any) -> None:
        # The C drafter kernels run DART's layer, not DFlash's (injected context, non-causal block): torch here.
        kw["fast_step"] = False
        super().__init__(model, target, tree, **kw)


def build(target: FeatureSource, options: DrafterOptions) -> DartDrafter:
    """The registry's builder of ``dflash``: ``options.checkpoint`` or the shipped one, DART's tree options."""
    return build_parallel(DFlashDrafter, "dflash", "DFlash", target, options)
