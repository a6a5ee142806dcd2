"""``dartspec train curve``: a drafter's learning curve from its training logs, with a fit to extrapolate.

A drafter is trained in pieces (a first run, warm starts, GPU windows, CPU runs between them), each with its own
``train_log.jsonl`` whose step count starts again at 1. Given the logs in training order, the curve joins them on
one axis of training tokens seen (``tokens_per_s x seconds`` per step), plots the training loss (a moving
average) and the dev depth-1 top-1 at each evaluation, and fits dev top-1 as a straight line in log10(tokens):
the slope says what ten times the training tokens would buy, and the line where it would reach a goal, if the trend
holds (a rough guide, not a promise: a warm start that sees its data again bends below it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dartspec.errors import DartspecError


@dataclass(frozen=True)
class Curve:
    """Training loss per step and dev depth-1 top-1 per evaluation, against cumulative training tokens."""

    tokens: list[float]
    loss: list[float]
    dev_tokens: list[float]
    dev_top1: list[float]
    runs: list[tuple[str, float]]  # (log file, cumulative tokens where it ends)

    def fit(self) -> tuple[float, float] | None:
        """``(slope per decade of tokens, intercept)`` of dev top-1 against log10(tokens); None if < 3 points."""
        points = [(math.log10(t), y) for t, y in zip(self.dev_tokens, self.dev_top1, strict=True) if t > 0]
        if len(points) < 3:
            return None
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        sxx = sum((x - mx) ** 2 for x, _ in points)
        if sxx == 0:
            return None
        slope = sum((x - mx) * (y - my) for x, y in points) / sxx
        return slope, my - slope * mx

    def tokens_for(self, goal: float) -> float | None:
        """Training tokens at which the fitted line reaches dev top-1 ``goal``; None without a rising fit."""
        fitted = self.fit()
        if fitted is None or fitted[0] <= 0:
            return None
        slope, intercept = fitted
        return 10 ** ((goal - intercept) / slope)


def load_curve(paths: Sequence[str | Path]) -> Curve:
    tokens, loss, dev_tokens, dev_top1, runs = [], [], [], [], []
    seen = 0.0
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as err:
            raise DartspecError(f"cannot read training log {path}: {err.strerror}") from None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                seen += float(row["tokens_per_s"]) * float(row["seconds"])
                value = float(row["loss"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise DartspecError(f"{path} line {number} is not a dartspec training log record") from None
            if math.isfinite(value):
                tokens.append(seen)
                loss.append(value)
            if "dev_top1" in row:
                dev_tokens.append(seen)
                dev_top1.append(float(row["dev_top1"][0]))
        runs.append((str(path), seen))
    if not tokens:
        raise DartspecError("the training logs hold no steps")
    return Curve(tokens, loss, dev_tokens, dev_top1, runs)


def describe(curve: Curve, goal: float | None = None) -> str:
    lines = [f"{len(curve.loss)} steps, {curve.tokens[-1] / 1e6:.2f} M training tokens in {len(curve.runs)} run(s)"]
    if curve.dev_top1:
        lines.append(f"dev depth-1 top-1: {curve.dev_top1[0]:.3f} -> {curve.dev_top1[-1]:.3f}")
    fitted = curve.fit()
    if fitted is not None:
        slope, intercept = fitted
        now = math.log10(curve.tokens[-1])
        lines.append(
            f"fit: top-1 = {intercept:.3f} + {slope:.3f} x log10(tokens); 10x the tokens -> "
            f"{intercept + slope * (now + 1):.3f} if the trend holds"
        )
    if goal is not None:
        needed = curve.tokens_for(goal)
        if curve.dev_top1 and curve.dev_top1[-1] >= goal:  # reached, whatever the trend
            lines.append(f"goal {goal:.3f}: reached")
        elif needed is None:
            lines.append(f"goal {goal:.3f}: no rising trend to extrapolate (need 3+ dev points that climb)")
        else:
            lines.append(
                f"goal {goal:.3f}: ~{needed / 1e6:.1f} M training tokens in all "
                f"({needed / curve.tokens[-1]:.1f}x those seen) if the trend holds"
            )
    return "\n".join(lines)


def plot(curve: Curve, out: str | Path, title: str = "") -> None:
    from dartspec.plotting import pyplot

    plt = pyplot("the learning-curve plot")
    fig, (ax_loss, ax_dev) = plt.subplots(1, 2, figsize=(10, 3.6))
    window = max(1, len(curve.loss) // 50)
    smooth = [
        sum(curve.loss[max(0, i - window + 1) : i + 1]) / (i - max(0, i - window + 1) + 1)
        for i in range(len(curve.loss))
    ]
    millions = [t / 1e6 for t in curve.tokens]
    ax_loss.plot(millions, curve.loss, color="0.8", linewidth=0.6)
    ax_loss.plot(millions, smooth, color="C0")
    ax_loss.set(xlabel="training tokens (M)", ylabel="training loss", title="loss")
    if curve.dev_top1:
        ax_dev.plot([t / 1e6 for t in curve.dev_tokens], curve.dev_top1, "o-", color="C1", label="dev")
        fitted = curve.fit()
        if fitted is not None:
            slope, intercept = fitted
            xs = [curve.dev_tokens[0], curve.tokens[-1] * 10]
            ax_dev.plot(
                [x / 1e6 for x in xs],
                [intercept + slope * math.log10(x) for x in xs],
                "--",
                color="0.5",
                label=f"fit: +{slope:.3f} per 10x tokens",
            )
        ax_dev.set_xscale("log")
        ax_dev.legend()
    ax_dev.set(xlabel="training tokens (M)", ylabel="depth-1 top-1", title="dev accuracy")
    for _, end in curve.runs[:-1]:
        for ax in (ax_loss, ax_dev):
            ax.axvline(end / 1e6, color="0.85", linestyle=":")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
