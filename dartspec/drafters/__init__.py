"""Drafters: everything that proposes draft trees. ``make_drafter`` builds one by name from the registry
(:data:`dartspec.formats.DRAFTERS`: a new drafter is its own file with a ``build`` function and one line there)."""

from __future__ import annotations

import importlib
from pathlib import Path

from dartspec.drafters.base import DraftBudget, Drafter, NoDrafter
from dartspec.drafters.options import DrafterOptions, checkpoint_folder, shipped_checkpoint
from dartspec.drafters.pld import PromptLookupDrafter
from dartspec.formats import DRAFTER_NAMES, DRAFTERS, check_drafter_name
from dartspec.runtime import on_cpu

#: The drafters that run a network over the target's features each step (``--tree-size auto`` applies to them).
FEATURE_DRAFTERS = tuple(d.name for d in DRAFTERS if d.feature)


def drafter_names() -> list[str]:
    """What ``--drafter`` accepts: ``auto`` and every drafter's name."""
    return ["auto", *DRAFTER_NAMES]


def default_drafter(device, model: str | None = None) -> str:
    """The static default for the target ``model`` on ``device``, before any measurement on this machine: where it is
    ``dart+pld``, the first ``--drafter auto`` times it against prompt lookup alone and plain decoding and keeps the
    fastest (:func:`dartspec.tune.auto_drafter`; on an Intel Xeon with AMX prompt lookup alone won).

    On a CPU, DART with prompt lookup's spans (``dart+pld``, with its default budget: 4 nodes, DART's tree at most 3,
    :func:`dartspec.engine.default_budget`) where a DART drafter ships for the model, else prompt lookup (no model,
    bit-identical output). One 2-core Zen 3, 128 new tokens, interleaved (BENCHMARKS.md): the hybrid (DART's tree at
    most 2) ran at a median 1.29x plain decoding on 80 development prompts (ShareGPT 14000+), 1.12x on MT-Bench and
    1.24x on HumanEval, prompt lookup alone 1.20x, 1.04x and 1.14x; one 2-core AVX-512 EPYC, DART's tree at most 3:
    1.31x on the development prompts, 1.19x / 1.18x on MT-Bench / HumanEval (20 each), prompt lookup 1.08x / 1.10x.
    On a GPU, plain decoding: there the lean forward's steps run as CUDA graphs by default, which made plain decoding
    2.8-3.8x as fast (the fourth window, one H100, float32), and
    against that DART with lookup spans measured 0.80-0.88x on MT-Bench (1.39-1.52x on HumanEval, 4-5 prompts a set,
    0 mismatches): its drafter forward and tree search then still ran eagerly, ~38% of a step."""
    if not on_cpu(device):
        return "none"
    return "dart+pld" if model is not None and shipped_checkpoint("dart", model) is not None else "pld"


def default_max_draft_temperature(device) -> float | None:
    """Above what sampling temperature ``--drafter auto`` decodes a request plainly on ``device`` (None: never).

    On a CPU a verified row is not free, and a flatter distribution accepts fewer drafts (a drafted token is kept
    with the target's probability of it). On development prompts (ShareGPT 14100+, 40, 128 new tokens, one 2-core
    Zen 3) ``dart+pld`` ran at a median 1.13x plain decoding at temperature 0.3, 1.04x at 0.5, 0.90-0.99x at 0.7 and
    0.83x at 1.0 (prompt lookup 1.10x, 1.05x, 0.98-1.00x, 0.98x): drafts pay up to 0.5. Re-measured on the faster
    runtime (40 other dev prompts, docs/bench/sampled-default-check-2026-11-27): 1.28x / 1.18x / 1.03x / 0.85x, with
    sampled drafts 1.24x / 1.14x / 1.01x / 0.92x. On a GPU the default is plain decoding already."""
    return 0.5 if on_cpu(device) else None


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
    draft_nodes: int | None = None,
    draft_context: int | None = None,
) -> Drafter:
    """A drafter for ``target`` by name (``auto``: :func:`dartspec.tune.auto_drafter`, the fastest here), built by
    its registry line's ``build`` from these options (:class:`DrafterOptions`; each drafter's ``build`` documents
    the ones it reads: ``dart`` in :func:`dartspec.drafters.dart.build`, ``eagle3`` in
    :func:`dartspec.drafters.eagle3.build`, ``dart+pld`` in :func:`dartspec.drafters.hybrid.build`)."""
    if name == "auto":
        from dartspec.tune import auto_drafter

        name = auto_drafter(target, checkpoint)
    kind = check_drafter_name(name)
    assert kind is not None  # "auto" was resolved above
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
        draft_nodes=draft_nodes,
        draft_context=draft_context,
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
    "default_drafter",
    "default_max_draft_temperature",
    "drafter_names",
    "make_drafter",
    "shipped_checkpoint",
]
