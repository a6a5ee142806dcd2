"""DFlash as a :class:`~dartspec.drafters.base.Drafter`: DART's drafting loop (feature queue, draft cache, trees by
the beam search or DDTree over the per-depth rows, n-grams, ``--tree-size auto``) over the DFlash network
(:mod:`dartspec.drafters.dflash_model`). The proposal is the tree of the rows' top tokens, so verification stays
exact as for every drafter."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dartspec.drafters.dart import DartDrafter, build_parallel
from dartspec.drafters.dflash_model import DFlashModel
from dartspec.drafters.options import DrafterOptions, checkpoint_folder, shipped_checkpoint
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
    """The registry's builder of ``dflash``: ``options.checkpoint`` or the shipped one, DART's tree options. A
    checkpoint without its own ``ngram.bin`` uses the shipped DART drafter's (an n-gram of the same target's
    training answers) rather than store a second copy."""
    folder = checkpoint_folder("dflash", target, options.checkpoint, "DFlash")
    dart = shipped_checkpoint("dart", target.name)
    if not options.ngram and not (folder / "ngram.bin").is_file() and dart and (dart / "ngram.bin").is_file():
        options = replace(options, ngram=dart / "ngram.bin")
    options = replace(options, checkpoint=folder)  # resolved once
    return build_parallel(DFlashDrafter, "dflash", "DFlash", target, options)
