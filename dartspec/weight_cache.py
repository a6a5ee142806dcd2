"""On-disk cache of a model's packed weights (the ``exact`` formats), so that loading skips the packing.

Finding and checking the integer groups of every weight and laying them out for the kernel takes a few
seconds per load (SmolLM2: ~2.5 s of a 3.8 s load); the result depends only on the model's weight files,
the format and the kernel's panel width, so it is written once under ``<cache>/packed/`` as one safetensors
file and a manifest (format, source, size and sha256 of that file), keyed by those inputs:

- written to temporary names, flushed to disk, then renamed: the safetensors file first and the manifest
  last, so a manifest only ever describes a complete file (a crash in between leaves a file without a
  manifest, which the next load rebuilds);
- read back only when its size and sha256 match the manifest: a damaged cache is a one-line error that
  names the files to delete, never weights silently wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from dartspec import atomic, exact
from dartspec.errors import DartspecError
from dartspec.exact import ExactWeight
from dartspec.model_cache import sha256

#: Bump when the packed layout or the lean weight preparation (fusion, rotary row order) changes.
PACKED_VERSION = 12  # 4-12: K-quant weights as integer groups read from the GGUF file (dartspec.kquants)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


class PackedCache:
    """The cache file of one model folder in one packed format."""

    def __init__(self, path: Path, source: str) -> None:
        self.path = path
        self.manifest = path.with_suffix(".json")
        self.source = source

    @classmethod
    def for_model(
        cls, folder: str | os.PathLike[str] | None, fmt: str, panel: int, parameters: Iterable[torch.Tensor]
    ) -> PackedCache | None:
        """The cache for the model loaded from ``folder`` whose weights are now ``parameters`` (None when the
        model has no folder of weight files, e.g. one built in memory: nothing identifies it)."""
        from dartspec.assets import cache_dir

        if not folder or not Path(folder).is_dir():
            return None
        root = Path(folder).resolve()
        files = sorted(f for f in root.iterdir() if f.suffix in _WEIGHT_SUFFIXES and f.is_file())
        if not files:
            return None
        # Keyed by path, size and mtime of the weight files (hashing them on every load would cost seconds;
        # a file rewritten in place changes its mtime).
        stats = [f"{f.name}\0{f.stat().st_size}\0{f.stat().st_mtime_ns}" for f in files]
        # ... and by a float64 sum of every parameter (~0.1 s), so that weights changed in memory after loading
        # never meet a cache made from the files.
        sums = [repr(float(p.detach().sum(dtype=torch.float64))) for p in parameters]
        source = "\0".join([str(root), *stats, *sums, fmt, str(panel), str(PACKED_VERSION)])
        key = hashlib.sha256(source.encode()).hexdigest()[:16]
        return cls(cache_dir() / "packed" / f"{root.name[:60]}-{fmt}-p{panel}-{key}.safetensors", source)

    def load(self) -> SavedWeights | None:
        """The cached weights, or None when there is no complete cache yet.

        Raises:
            DartspecError: the manifest or the file is damaged (names both files to delete).
        """
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if not self.manifest.is_file():
            return None
        try:
            manifest = json.loads(self.manifest.read_text(encoding="utf-8"))
            expected = (manifest["version"], manifest["source"])
            size, digest = int(manifest["size"]), str(manifest["sha256"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise self.damaged(f"its manifest is unreadable: {exc}") from None
        if expected != (PACKED_VERSION, self.source):
            raise self.damaged("its manifest belongs to another model or version")
        try:
            actual = self.path.stat().st_size
        except FileNotFoundError:
            raise self.damaged("the weights file is missing") from None
        if actual != size:
            raise self.damaged(f"the weights file is {actual} bytes, expected {size}")
        if sha256(self.path) != digest:
            raise self.damaged("the weights file does not match its recorded sha256")
        try:
            tensors = load_file(self.path)
        except (OSError, SafetensorError) as exc:
            raise self.damaged(f"cannot read it: {exc}") from None
        by_weight: dict[str, dict[str, torch.Tensor]] = {}  # "layers.0.qkv.data" -> ["layers.0.qkv"]["data"]
        for key, value in tensors.items():
            name, _, field = key.rpartition(".")
            by_weight.setdefault(name, {})[field] = value
        try:
            return SavedWeights(self, {name: exact.from_tensors(t) for name, t in by_weight.items()})
        except (KeyError, ValueError):
            raise self.damaged("a packed weight in it is inconsistent") from None

    def save(self, weights: dict[str, ExactWeight]) -> None:
        """Write ``weights`` atomically (see the module docstring)."""
        from safetensors.torch import save_file

        tensors = {f"{name}.{k}": v for name, w in weights.items() for k, v in exact.to_tensors(w).items()}
        with atomic.atomic_path(self.path) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
            digest, size = sha256(tmp), tmp.stat().st_size
        manifest = {"version": PACKED_VERSION, "source": self.source, "size": size, "sha256": digest}
        atomic.write_text(self.manifest, json.dumps(manifest, indent=1) + "\n")
        self._remove_older_versions()

    def _remove_older_versions(self) -> None:
        """Delete this cache's predecessors: files of the same weights and format written by an older
        ``PACKED_VERSION`` (their source differs only in its last field), which this version never reads. A
        copy of the model's weights each (~100 MB for SmolLM2) would otherwise pile up with every layout change."""
        same_weights = self.source.rpartition("\0")[0]
        for manifest in self.manifest.parent.glob("*.json"):
            if manifest == self.manifest:
                continue
            try:
                old = json.loads(manifest.read_text(encoding="utf-8"))
                older = old["version"] != PACKED_VERSION and old["source"].rpartition("\0")[0] == same_weights
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue  # not ours to judge
            if older:
                manifest.with_suffix(".safetensors").unlink(missing_ok=True)
                manifest.unlink(missing_ok=True)

    def damaged(self, why: str) -> DartspecError:
        return DartspecError(
            f"the packed-weight cache {self.path} is damaged ({why}): delete {self.path} and {self.manifest} "
            "and run again to rebuild it"
        )


@dataclass(frozen=True)
class SavedWeights:
    """The packed weights read from a :class:`PackedCache`, by linear layer name."""

    cache: PackedCache
    weights: dict[str, ExactWeight]

    def get(self, name: str, shape: tuple[int, ...]) -> ExactWeight:
        """The packed form of weight ``name`` of ``shape``; a damaged-cache error when the cache lacks it."""
        packed = self.weights.get(name)
        if packed is None or (packed.out_features, packed.in_features) != shape:
            raise self.cache.damaged(f"{name} is missing or does not have the model's shape")
        return packed
