"""Online training of the EAGLE-3 baseline: DART's trainer (data, loop, checkpoints, resume) with the
training-time-test objective of :mod:`dartspec.train.eagle3_loss`.

``init`` may name a DART checkpoint: EAGLE-3's first step is DART's depth-1 row, so the whole network
starts from it (the comparison then gives EAGLE-3 DART's training budget plus its own).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dartspec.drafters.dart_model import FORMAT as DART_FORMAT
from dartspec.drafters.eagle3_model import Eagle3Model
from dartspec.train.dart import DartTrainer


class Eagle3Trainer(DartTrainer):
    """Trains :class:`~dartspec.drafters.eagle3_model.Eagle3Model`; ``cfg.depth`` = unrolled steps."""

    name = "eagle3"
    model_cls = Eagle3Model

    def load_init(self, folder: str) -> Eagle3Model:
        """An EAGLE-3 checkpoint, or a DART one converted by :meth:`Eagle3Model.from_dart` (same depth as asked)."""
        try:
            fmt = json.loads((Path(folder) / "config.json").read_text()).get("format")
        except (OSError, json.JSONDecodeError, AttributeError):
            fmt = None  # let the loader give its precise error
        if fmt == DART_FORMAT:
            return Eagle3Model.from_dart(folder, depth=self.cfg.depth, device=self.target.device, target=self.target)
        return Eagle3Model.load(folder, device=self.target.device, dtype=torch.float32, target=self.target)
