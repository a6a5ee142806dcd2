"""Drafters: everything that proposes draft trees. ``make_drafter`` builds one by name."""

from __future__ import annotations

from pathlib import Path

from dartspec.drafters.base import DraftBudget, Drafter, NoDrafter
from dartspec.drafters.pld import PromptLookupDrafter
from dartspec.errors import DartspecError
from dartspec.formats import DRAFTER_NAMES

#: Drafter checkpoints that ship inside the package, by target model name.
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "checkpoints"

#: The drafters that run a network over the target's features each step (``--tree-size auto`` applies to them).
FEATURE_DRAFTERS = ("dart", "dart+pld", "eagle3")


def drafter_names() -> list[str]:
    """What ``--drafter`` accepts: ``auto`` and every drafter's name."""
    return ["auto", *DRAFTER_NAMES]


def default_drafter(device) -> str:
    """What ``--drafter auto`` (the command line's default) means on ``device``: prompt lookup on a CPU, where it
    was the fastest drafter and never meaningfully slower than plain decoding (BENCHMARKS.md, exact-a16 runtime,
    first 10 prompts, three runs: median 1.05-1.15x on MT-Bench, worst prompt 0.96-0.98x; 1.16-1.22x on HumanEval,
    worst 1.03-1.10x; lookup costs
    no model and its output is bit-identical to plain decoding there); plain decoding elsewhere (not measured on a
    GPU yet, where bfloat16 tree verification may also tip near-ties)."""
    return "pld" if str(getattr(device, "type", device)) == "cpu" else "none"


def shipped_checkpoint(kind: str, model_name: str) -> Path | None:
    """The packaged ``kind`` drafter (e.g. ``dart``) for a known target name, if one ships."""
    folder = SHIPPED_DIR / f"{model_name}-{kind}"
    return folder if (folder / "config.json").is_file() else None


def checkpoint_folder(kind: str, target, checkpoint: str | Path | None, label: str = "") -> Path:
    """``checkpoint``, or the ``kind`` drafter shipped for ``target``; a clear error (naming ``label``) when
    neither exists."""
    if checkpoint:
        return Path(checkpoint)
    folder = shipped_checkpoint(kind, target.name)
    if folder is None:
        label = label or kind
        raise DartspecError(
            f"no {label} drafter ships for {target.name!r}: train one with `dartspec train {kind}` "
            "and pass it with --drafter-path"
        )
    return folder


def make_drafter(
    name: str,
    target,
    checkpoint: str | Path | None = None,
    *,
    tree: str = "beam",
    ngram: str | Path | None = None,
    online_ngram: bool = False,
    auto_size: bool = False,
    drafter_nodes: int = 4,
    ngram_smoothing: float = 0.0,
    topk: int = 4,
) -> Drafter:
    """A drafter for ``target`` by name: ``none``, ``pld``, or ``dart`` (``checkpoint`` or the shipped one);
    ``auto`` is :func:`default_drafter` for the target's device.

    For ``dart``: ``tree`` picks the builder (beam, ddtree, chain), ``ngram`` a static n-gram file (default:
    the one shipped next to the drafter, if any; ``"off"`` for none), ``online_ngram`` adds prompt/output n-grams,
    ``auto_size`` cuts each tree to the size with the best expected tokens/s on this machine (the engine's
    ``tree_size`` is then the largest size considered; see :mod:`dartspec.tree_size`). ``dart+pld`` merges
    prompt-lookup spans into a DART tree of ``drafter_nodes`` nodes (:mod:`dartspec.drafters.hybrid`).
    ``ngram_smoothing`` (0 < s < 1) scores with the interpolated n-gram instead of DART's longest-context rule.
    ``eagle3`` is the EAGLE-3 baseline (``checkpoint`` or the shipped one) with EAGLE-2's dynamic tree, expanding
    ``topk`` nodes per level (``auto_size`` cuts it by path probability, as for ``dart``).
    """
    if name == "auto":
        name = default_drafter(target.device)
    if name == "none":
        return NoDrafter()
    if name == "pld":
        return PromptLookupDrafter()
    if name == "dart+pld":
        from dartspec.drafters.hybrid import HybridDrafter

        dart = make_drafter(
            "dart",
            target,
            checkpoint,
            tree=tree,
            ngram=ngram,
            online_ngram=online_ngram,
            auto_size=auto_size,
            ngram_smoothing=ngram_smoothing,
        )
        return HybridDrafter(dart, drafter_nodes=drafter_nodes)
    if name == "eagle3":
        from dartspec.drafters.eagle3 import Eagle3Drafter

        folder = checkpoint_folder("eagle3", target, checkpoint, "EAGLE-3")
        return Eagle3Drafter.from_pretrained(folder, target, topk=topk, auto_size=_auto_sizer(target, auto_size))
    if name == "dart":
        from dartspec.drafters.dart import DartDrafter

        folder = checkpoint_folder("dart", target, checkpoint, "DART")
        from dartspec.ngram import NgramModel, SmoothedNgram, tokenizer_identity

        if ngram == "off":
            ngram_path = None
        elif ngram:
            ngram_path = Path(ngram)
        else:
            ngram_path = folder / "ngram.bin" if (folder / "ngram.bin").is_file() else None
        static = NgramModel.load(ngram_path, tokenizer=tokenizer_identity(target.tokenizer)) if ngram_path else None
        if static is not None and ngram_smoothing:
            static = SmoothedNgram(static, ngram_smoothing)
        return DartDrafter.from_pretrained(
            folder, target, tree, ngram=static, online_ngram=online_ngram, auto_size=_auto_sizer(target, auto_size)
        )
    raise DartspecError(f"unknown drafter {name!r}: choose one of {', '.join(drafter_names())}")


def _auto_sizer(target, wanted: bool):  # -> AutoSizer | None
    """The ``--tree-size auto`` policy on this machine's verify cost curve (measured once, cached)."""
    if not wanted:
        return None
    from dartspec.tree_size import AutoSizer, calibrate

    return AutoSizer(calibrate(target))


__all__ = [
    "FEATURE_DRAFTERS",
    "DraftBudget",
    "Drafter",
    "NoDrafter",
    "PromptLookupDrafter",
    "drafter_names",
    "make_drafter",
]
