"""Glue between the ``dartspec train`` command line and the trainers."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from dartspec.data.shards import load_shards
from dartspec.train.dart import DartTrainer, Sample, TrainConfig


def samples_from(folders: str | list[str]) -> list[Sample]:
    """All samples of one or more regenerated data folders, in folder order."""
    names = [folders] if isinstance(folders, str) else folders
    return [Sample(r.tokens, r.prompt_len, r.index) for folder in names for r in load_shards(folder)]


def trainer_kind(kind: str) -> tuple[type[DartTrainer], dict[str, Any]]:
    """``dartspec train KIND``'s trainer class and its built-in config (used without ``--config``)."""
    if kind == "eagle3":
        from dartspec.train.eagle3 import Eagle3Trainer

        return Eagle3Trainer, {}
    if kind == "dflash":
        from dartspec.train.dflash import DEFAULTS, DFlashTrainer

        return DFlashTrainer, DEFAULTS
    if kind != "dart":
        raise ValueError(f"unknown trainer {kind!r}")
    return DartTrainer, {}


def run_training(kind: str, args: argparse.Namespace, target: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """Train (or resume) a drafter of ``kind`` as the command line asks."""
    trainer_cls, defaults = trainer_kind(kind)
    cfg = TrainConfig.from_file(args.config) if args.config else TrainConfig(**defaults)
    if args.max_steps is not None:
        cfg = replace(cfg, max_steps=args.max_steps)
    if getattr(args, "init", None):
        cfg = replace(cfg, init=args.init)
    if getattr(args, "feature_cache", None):
        cfg = replace(cfg, feature_cache=args.feature_cache)
    train = samples_from(args.data)
    dev = samples_from(args.dev) if args.dev else []
    log(f"training on {len(train)} samples ({sum(len(s.tokens) for s in train)} tokens), dev {len(dev)}")
    trainer = trainer_cls(target, train, dev, args.out, cfg, log=log)
    max_seconds = args.max_minutes * 60 if args.max_minutes is not None else None  # argparse checked it is > 0
    metrics = trainer.fit(
        resume=args.resume,
        stop_after=args.stop_after,
        max_seconds=max_seconds,
        new_data=args.new_data,
        fit_schedule=getattr(args, "fit_schedule", False),
    )
    log(f"saved {args.out} at step {trainer.step}/{trainer.total_steps}")
    return metrics
