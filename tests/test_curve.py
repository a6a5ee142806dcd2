"""``train curve``: logs joined on one token axis, the log-linear fit, the plot and bad logs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dartspec.errors import DartspecError
from dartspec.train.curve import describe, load_curve, plot


def write_log(path: Path, steps: int, top1: dict[int, float]) -> Path:
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "loss": 10.0 / step, "tokens_per_s": 100.0, "seconds": 10.0}
        if step in top1:
            row["dev_top1"] = [top1[step], 0.1]
        rows.append(json.dumps(row))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_runs_join_on_one_token_axis_and_the_fit_recovers_a_log_linear_trend(tmp_path: Path) -> None:
    # 1000 tokens a step; dev top-1 = 0.1 x log10(tokens) exactly, across two runs (the second restarts at step 1).
    first = write_log(tmp_path / "a.jsonl", 10, {1: 0.3, 10: 0.4})
    second = write_log(tmp_path / "b.jsonl", 90, {90: 0.5})
    curve = load_curve([first, second])
    assert curve.tokens[-1] == 100_000 and len(curve.loss) == 100
    assert curve.dev_tokens == [1000, 10_000, 100_000] and curve.runs[0][1] == 10_000
    slope, intercept = curve.fit()
    assert math.isclose(slope, 0.1) and math.isclose(intercept, 0.0, abs_tol=1e-12)
    assert "10x the tokens -> 0.600" in describe(curve)
    # 0.7 = 0.1 x log10(tokens) at 10^7 tokens: 100x the 10^5 seen.
    assert math.isclose(curve.tokens_for(0.7), 1e7)
    assert "goal 0.700: ~10.0 M training tokens in all (100.0x those seen)" in describe(curve, 0.7)
    assert "goal 0.450: reached" in describe(curve, 0.45)


def test_a_flat_or_falling_curve_has_no_goal_estimate(tmp_path: Path) -> None:
    curve = load_curve([write_log(tmp_path / "a.jsonl", 30, {10: 0.4, 20: 0.4, 30: 0.39})])
    assert curve.tokens_for(0.7) is None
    assert "no rising trend" in describe(curve, 0.7)
    assert "goal 0.350: reached" in describe(curve, 0.35)  # a goal already met needs no trend


def test_too_few_points_have_no_fit_and_bad_logs_are_named(tmp_path: Path) -> None:
    assert load_curve([write_log(tmp_path / "a.jsonl", 5, {5: 0.2})]).fit() is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\n')
    with pytest.raises(DartspecError, match=r"bad\.jsonl line 1"):
        load_curve([bad])
    with pytest.raises(DartspecError, match="cannot read"):
        load_curve([tmp_path / "missing.jsonl"])


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    curve = load_curve([write_log(tmp_path / "a.jsonl", 30, {10: 0.3, 20: 0.35, 30: 0.38})])
    plot(curve, tmp_path / "c.png", "title")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
