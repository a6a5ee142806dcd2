"""``dartspec bench train``: training tokens/s of the drafter trainers, packing, precision, feature cache and the
runtime that scores the sequences side by side.

Each setting is its own trainer (same data order, same start: a fresh network or ``--init``) taking one
optimizer step per round, the settings in rotating order so that drift on a shared machine hits all of
them alike; the first round warms up and is not counted. Tokens are the target tokens of the step's
sequences (prompt + answer, cut at ``max_seq_len``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from dartspec.errors import DartspecError
from dartspec.runtime import describe
from dartspec.targets import parse_format, wrap_format
from dartspec.train.dart import PRECISIONS, DartTrainer, Sample, TrainConfig, resolve_precision


def _is_format(value: str) -> bool:
    try:
        parse_format(value)
    except DartspecError:
        return False
    return True


def parse_setting(text: str) -> dict[str, Any]:
    """``pack=1,precision=fp32,cache=1,target=lean:exact-a16`` -> TrainConfig overrides (pack: int, precision: str,
    feature_cache: bool, which the bench turns into a folder of its own) and ``target``: the runtime that scores the
    sequences, ``RUNTIME[:QUANT]`` over the loaded model; ValueError if malformed."""
    out: dict[str, Any] = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key == "pack" and value.isdigit():
            out[key] = int(value)
        elif key == "precision" and value in PRECISIONS:
            out[key] = value
        elif key == "cache" and value in ("0", "1"):
            out["feature_cache"] = value == "1"
        elif key == "target" and _is_format(value):
            out[key] = value
        else:
            raise ValueError(
                f"{part!r}: expected pack=N, precision={'|'.join(PRECISIONS)}, cache=0|1 or target=lean|hf[:QUANT]"
            )
    return out


def run_train_bench(
    target: Any,
    train: Sequence[Sample],
    settings: Sequence[str],
    cfg: TrainConfig,
    *,
    trainer_cls: type[DartTrainer] = DartTrainer,
    rounds: int = 4,
    log: Callable[[str], None] = print,
    out: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Median tokens/s and step seconds of each setting (``pack=N,precision=P``) over ``rounds`` counted steps."""
    trainers = []
    # One data order for every setting (the same losses after the same steps): length-sorted steps as packed
    # training runs them, unless the config names an order (sorting changes no speed where sequences run alone).
    cfg = replace(cfg, length_sort_steps=cfg.length_sort_steps or 16)
    with tempfile.TemporaryDirectory() as tmp:
        # Every setting trains on the same samples, as many as the rounds use: a cached setting is timed on
        # what later epochs cost (its cache filled first, untimed), the others on what any step costs.
        used = list(train[: (rounds + 1) * cfg.seqs_per_step])
        for i, text in enumerate(settings):
            overrides = parse_setting(text)
            scorer_target = wrap_format(target, overrides.pop("target")) if "target" in overrides else target
            if overrides.get("feature_cache"):
                overrides["feature_cache"] = str(Path(tmp) / f"cache-{i}")
            else:
                overrides.pop("feature_cache", None)
            setting_cfg = replace(cfg, **overrides)
            trainer = trainer_cls(scorer_target, used, [], Path(tmp) / str(i), setting_cfg, log=lambda m: None)
            trainer.build()
            if setting_cfg.feature_cache:
                scorer = trainer.scorer()
                for s in used:
                    scorer.score_batch([s.tokens[: setting_cfg.max_seq_len].tolist()])
            trainers.append(trainer)
        timings: list[list[dict[str, Any]]] = [[] for _ in settings]
        for r in range(rounds + 1):
            order = list(range(len(settings)))
            order = order[r % len(order) :] + order[: r % len(order)]
            for i in order:
                metrics = trainers[i].train_step()
                if r:  # round 0 warms up (allocator, kernels, caches)
                    timings[i].append(metrics)
    rows = []
    for text, runs, trainer in zip(settings, timings, trainers, strict=True):
        rows.append(
            {
                "setting": text or "default",
                "precision": resolve_precision(trainer.cfg.precision, trainer.target.device),
                "scorer": describe(trainer.target),
                "tokens_per_s": statistics.median(m["tokens_per_s"] for m in runs),
                "step_seconds": statistics.median(m["seconds"] for m in runs),
                "loss": runs[-1]["loss"],
            }
        )
    base = rows[0]["tokens_per_s"]
    lines = [
        f"### {trainer_cls.name} trainer on {target.name} ({target.device.type}), {cfg.seqs_per_step} sequences "
        f"per step, {rounds} steps each",
        "",
        "| setting | precision | scored by | tokens/s | step s | vs first | loss after |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['setting']} | {row['precision']} | {row['scorer']} | {row['tokens_per_s']:.0f} | "
            f"{row['step_seconds']:.2f} | "
            f"{row['tokens_per_s'] / base:.2f}x | {row['loss']:.4f} |"
        )
    report = "\n".join(lines)
    log(report)
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "train_speed.md").write_text(report + "\n")
        (folder / "train_speed.json").write_text(json.dumps(rows, indent=2) + "\n")
    return rows
