"""Online training of the DFlash drafter: DART's trainer (data, loop, checkpoints, resume, dev metrics) with the
block objective of :mod:`dartspec.train.dflash_loss` and the reference's choices where the config leaves them:
five feature layers spread over the target's depth, cross-entropy weighted exp(-(k-1)/7) per depth, one layer
(``dartspec train dflash`` without ``--config``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dartspec.drafters.dflash_model import DFlashModel, dflash_feature_layers
from dartspec.train.dart import DartTrainer, TrainConfig
from dartspec.train.dflash_loss import REFERENCE_DECAY

#: What ``train dflash`` uses without ``--config``: the reference's loss and weights, one layer: the CPU size (a
#: SmolLM2 drafting step of depth 8 on 2 cores costs 1.00 ms with 1 layer, 1.72 with 2, 3.86 with 5, against a
#: 3 ms verification; DART's step is 0.92 ms in torch, 0.37 on the C kernels). The reference's 5 layers are for
#: GPUs (scripts/dflash-window.yaml).
DEFAULTS: dict[str, Any] = {"loss": "ce", "depth_decay": REFERENCE_DECAY, "num_layers": 1}


class DFlashTrainer(DartTrainer):
    """Trains :class:`~dartspec.drafters.dflash_model.DFlashModel`; ``cfg.depth`` = mask slots of a block."""

    name = "dflash"
    model_cls = DFlashModel

    def __init__(self, target: Any, train: Any, dev: Any, out: Any, cfg: TrainConfig, **kw: Any) -> None:
        if cfg.feature_layers is None:
            cfg = replace(cfg, feature_layers=list(dflash_feature_layers(target.num_layers)))
        super().__init__(target, train, dev, out, cfg, **kw)
