"""Crash-safe file writes: a temporary file of a unique name beside the target, flushed to disk, renamed over it.

A reader sees the old file or the new one, never a torn one (the rename is atomic and happens after fsync); two
processes filling the same cache entry never write into one temporary file; a failed write leaves no temporary
file behind. Every file dartspec writes for later use (caches, checkpoints, manifests, logs cut back) goes
through :func:`atomic_path`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path to write ``path``'s new content to; on leaving the block it is flushed and renamed over
    ``path`` (on an exception it is deleted and ``path`` is untouched)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
