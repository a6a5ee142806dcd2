"""What a drafter is built from: the options every front end may set, and where its checkpoint is."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dartspec.errors import DartspecError

#: Drafter checkpoints that ship inside the package, by target model name.
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "checkpoints"


@dataclass(frozen=True)
class DrafterOptions:
    """Options of :func:`dartspec.drafters.make_drafter`; each drafter's ``build`` reads the ones it knows."""

    checkpoint: str | Path | None = None
    tree: str = "beam"
    ngram: str | Path | None = None
    online_ngram: bool = False
    auto_size: bool = False
    ngram_smoothing: float = 0.0
    topk: int = 4
    draft_nodes: int | None = None  # dart+pld: the network tree's share of the budget (None: what spans leave)
    draft_context: int | None = None  # dart+pld: the network drafts while the context is at most this long


def shipped_checkpoint(kind: str, model_name: str) -> Path | None:
    """The packaged ``kind`` drafter (e.g. ``dart``) for a known target name, if one ships."""
    folder = SHIPPED_DIR / f"{model_name}-{kind}"
    return folder if (folder / "config.json").is_file() else None


def checkpoint_folder(kind: str, target: Any, checkpoint: str | Path | None, label: str = "") -> Path:
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
