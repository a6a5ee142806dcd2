"""Online training of the DFlash drafter: DART's trainer (data, loop, checkpoints, resume, dev metrics) with the
block objective of :mod:`dartspec.train.dflash_loss` and the reference's choices where the config leaves them:
five feature layers spread over the target's depth, cross-entropy weighted exp(-(k-1)/7) per depth (``dartspec
train dflash`` without ``--config``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dartspec.drafters.dflash_model import DFlashModel, dflash_feature_layers
from dartspec.train.dart import DartTrainer, TrainConfig
from dartspec.train.dflash_loss import REFERENCE_DECAY

#: What ``train dflash`` uses without ``--config``: the reference's loss and weights, two layers (a CPU-sized
#: drafter; the reference's five are for GPUs).
DEFAULTS: dict[str, Any] = {"loss": "ce", "depth_decay": REFERENCE_DECAY, "num_layers": 2}


class DFlashTrainer(DartTrainer):
    """Trains :class:`~dartspec.drafters.dflash_model.DFlashModel`; ``cfg.depth`` = mask slots of a block."""

    name = "dflash"
    model_cls = DFlashModel

    def __init__(self, target: Any, train: Any, dev: Any, out: Any, cfg: TrainConfig, **kw: Any) -> None:
        if cfg.feature_layers is None:
            cfg = replace(cfg, feature_layers=list(dflash_feature_layers(target.num_layers)))
        super().__init__(target, train, dev, out, cfg, **kw)
