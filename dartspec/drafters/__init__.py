"""Drafters: everything that proposes draft trees. ``make_drafter`` builds one by name from the registry
(:data:`dartspec.formats.DRAFTERS`: a new drafter is its own file with a ``build`` function and one line there)."""

from __future__ import annotations

import importlib
from pathlib import Path

from dartspec.drafters.base import DraftBudget, Drafter, NoDrafter
from dartspec.drafters.options import DrafterOptions, checkpoint_folder, shipped_checkpoint
from dartspec.drafters.pld import PromptLookupDrafter
from dartspec.errors import DartspecError
from dartspec.formats import DRAFTER_NAMES, DRAFTERS, drafter_kind

#: The drafters that run a network over the target's features each step (``--tree-size auto`` applies to them).
FEATURE_DRAFTERS = tuple(d.name for d in DRAFTERS if d.feature)


def drafter_names() -> list[str]:
    """What ``--drafter`` accepts: ``auto`` and every drafter's name."""
    return ["auto", *DRAFTER_NAMES]


def default_drafter(device, model: str | None = None) -> str:
    """What ``--drafter auto`` (the command line's default) means for the target ``model`` on ``device``.

    On a CPU, prompt lookup: the fastest drafter there and about as fast as plain decoding at worst
    (BENCHMARKS.md, exact-a16 runtime: median 0.96-1.15x on MT-Bench over nine runs, worst prompt 0.88-0.98x;
    1.05-1.22x on HumanEval), costs no model, bit-identical output; ``dart+pld`` at 3 nodes ties with it there
    (1.03x against 1.04x on development prompts). On a GPU, where verifying 32 nodes costs about what one does, the
    shipped DART drafter with prompt-lookup spans in the same 32 nodes where the model has one: DART alone measured
    1.18-1.65x / 1.65-1.70x plain decoding on MT-Bench / HumanEval (one H200, float32, lean runtime, 4-5 prompts a
    set; 1.31x / 1.51x EAGLE-3, 0 mismatches), and the spans raise its replayed tau at the same budget by 11% / 25%
    (2.41 -> 2.67, 2.91 -> 3.63) for ~40 us of lookup a step; else plain decoding (lookup alone is not measured
    there)."""
    if str(getattr(device, "type", device)) == "cpu":
        return "pld"
    return "dart+pld" if model is not None and shipped_checkpoint("dart", model) is not None else "none"


def make_drafter(
    name: str,
    target,
    checkpoint: str | Path | None = None,
    *,
    tree: str = "beam",
    ngram: str | Path | None = None,
    online_ngram: bool = False,
    auto_size: bool = False,
    ngram_smoothing: float = 0.0,
    topk: int = 4,
) -> Drafter:
    """A drafter for ``target`` by name (``auto`` is :func:`default_drafter` for the target's device), built by
    its registry line's ``build`` from these options (:class:`DrafterOptions`; each drafter's ``build`` documents
    the ones it reads: ``dart`` in :func:`dartspec.drafters.dart.build`, ``eagle3`` in
    :func:`dartspec.drafters.eagle3.build`, ``dart+pld`` in :func:`dartspec.drafters.hybrid.build`)."""
    if name == "auto":
        name = default_drafter(target.device, target.name)
    kind = drafter_kind(name)
    if kind is None:
        raise DartspecError(f"unknown drafter {name!r}: choose one of {', '.join(drafter_names())}")
    module, _, function = kind.builder.partition(":")
    build = getattr(importlib.import_module(module), function)
    options = DrafterOptions(
        checkpoint=checkpoint,
        tree=tree,
        ngram=ngram,
        online_ngram=online_ngram,
        auto_size=auto_size,
        ngram_smoothing=ngram_smoothing,
        topk=topk,
    )
    return build(target, options)


__all__ = [
    "FEATURE_DRAFTERS",
    "DraftBudget",
    "Drafter",
    "DrafterOptions",
    "NoDrafter",
    "PromptLookupDrafter",
    "checkpoint_folder",
    "drafter_names",
    "make_drafter",
    "shipped_checkpoint",
]
