"""An on-disk fp16 cache of what the target computes for training sequences, so later epochs skip the target.

On a CPU the target's forward is about half of a DART training step, and it is the same every epoch: the
drafter learns from fixed target features. The cache stores, per training sequence, the features (the hidden
states entering the feature layers) and the final-norm hidden states, in fp16: 4.6 KB a token for SmolLM2,
against ~98 KB for its logits, which are recomputed from the hidden states by the LM head (a fifth of the
target's work). Sequences are found by their tokens, so any sampler and any data order can use it.

A run with the cache trains on the fp16-rounded values from its first epoch on (values just computed are
rounded before use too), so every epoch sees the same inputs. The folder is append-only: rows first, then an
index line naming them; a crash leaves at most rows no line names or a torn last line, both ignored, never a
line pointing at missing rows. A cache made for another target or other feature layers is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dartspec import atomic
from dartspec.errors import DartspecError
from dartspec.runtime import TargetOutput

FORMAT = "dartspec-feature-cache"
_ROWS, _INDEX, _META = "rows.f16", "index.tsv", "meta.json"


def _key(tokens: Sequence[int] | torch.Tensor | np.ndarray) -> str:
    ids = tokens.cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    return hashlib.sha1(ids.astype(np.int64).tobytes()).hexdigest()


def _signature(target: Any) -> dict[str, Any]:
    head = target.lm_head_weight()
    return {
        "format": FORMAT,
        "version": 1,
        "target": str(target.name),
        "feature_layers": list(target.feature_layers),
        "hidden_size": int(target.hidden_size),
        "vocab_size": int(target.vocab_size),
        # Weights changed under the same name (another quantization, a fine-tune) change this sum.
        "head_sum": round(float(head.detach().double().sum()), 6),
    }


class FeatureCache:
    """Scores whole sequences like ``target.score_batch``, from disk where it can (see the module doc)."""

    def __init__(self, target: Any, folder: str | Path) -> None:
        self.target = target
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        signature = _signature(target)
        meta_path = self.folder / _META
        if meta_path.exists():
            try:
                found = json.loads(meta_path.read_text())
            except (OSError, json.JSONDecodeError):
                raise DartspecError(f"{meta_path} is damaged: delete {self.folder} to rebuild the cache") from None
            if found != signature:
                raise DartspecError(
                    f"the feature cache {self.folder} was made for another target or feature layers "
                    f"({found.get('target')}, layers {found.get('feature_layers')}): use another folder"
                )
        else:
            atomic.write_text(meta_path, json.dumps(signature, indent=2) + "\n")
        self.width = (len(signature["feature_layers"]) + 1) * signature["hidden_size"]
        self.row_bytes = self.width * 2
        rows_path = self.folder / _ROWS
        rows_path.touch()
        self.rows_on_disk = rows_path.stat().st_size // self.row_bytes
        self.index: dict[str, tuple[int, int]] = {}
        index_path = self.folder / _INDEX
        if index_path.exists():
            text = index_path.read_text()
            if text and not text.endswith("\n"):
                with open(index_path, "a") as f:  # end a torn last line, so the next append starts a line of its own
                    f.write("\n")
            for line in text.splitlines():
                parts = line.split("\t")
                if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
                    continue  # a torn last line
                offset, length = int(parts[1]), int(parts[2])
                if offset + length <= self.rows_on_disk:
                    self.index[parts[0]] = (offset, length)
        self.hits = self.misses = 0

    # FeatureSource's face, as far as the training objectives use it.
    @property
    def device(self) -> torch.device:
        return self.target.device

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed(token_ids)

    def __len__(self) -> int:
        return len(self.index)

    def score_batch(self, sequences: Sequence[Sequence[int] | torch.Tensor]) -> TargetOutput:
        """Features ``(B, T, F*H)`` and logits ``(B, T, vocab)``, right-padded like ``target.score_batch``."""
        keys = [_key(s) for s in sequences]
        missing = [i for i, k in enumerate(keys) if k not in self.index]
        if missing:
            self._store([sequences[i] for i in missing], [keys[i] for i in missing])
        self.hits += len(sequences) - len(missing)
        self.misses += len(missing)
        rows = [self._read(k) for k in keys]
        width = max(r.shape[0] for r in rows)
        dtype = self.target.dtype
        packed = torch.stack([F.pad(r.to(dtype), (0, 0, 0, width - r.shape[0])) for r in rows]).to(self.device)
        h = self.target.hidden_size
        features, hidden = packed[..., :-h], packed[..., -h:]
        with torch.inference_mode():
            logits = self.target.logits(hidden.reshape(-1, h)).reshape(*hidden.shape[:2], -1)
        return TargetOutput(logits, features, hidden)

    def _store(self, sequences: list[Sequence[int] | torch.Tensor], keys: list[str]) -> None:
        out = self.target.score_batch(sequences)
        if out.hidden is None or out.features is None:
            raise DartspecError(f"{self.target.name}'s runtime does not return hidden states for the feature cache")
        rows = torch.cat([out.features, out.hidden], dim=-1).to(device="cpu", dtype=torch.float16)
        lines = []
        with open(self.folder / _ROWS, "ab") as f:
            for seq, key, block in zip(sequences, keys, rows, strict=True):
                n = len(seq)
                f.write(block[:n].contiguous().numpy().tobytes())
                lines.append((key, self.rows_on_disk, n))
                self.rows_on_disk += n
            f.flush()
            os.fsync(f.fileno())
        # Only now do index lines name the rows (a crash before this leaves unnamed rows, which are ignored).
        with open(self.folder / _INDEX, "a") as f:
            f.write("".join(f"{k}\t{o}\t{n}\n" for k, o, n in lines))
        for k, o, n in lines:
            self.index[k] = (o, n)

    def _read(self, key: str) -> torch.Tensor:
        offset, length = self.index[key]
        with open(self.folder / _ROWS, "rb") as f:
            f.seek(offset * self.row_bytes)
            data = f.read(length * self.row_bytes)
        if len(data) != length * self.row_bytes:
            raise DartspecError(f"the feature cache {self.folder} is truncated: delete it to rebuild")
        return torch.from_numpy(np.frombuffer(data, dtype=np.float16).reshape(length, self.width).copy())
