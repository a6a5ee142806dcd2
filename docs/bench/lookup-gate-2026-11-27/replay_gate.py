"""Greedy replay of PromptLookupDrafter (gated or not) on stored greedy answers, timed by a verify cost curve.

Usage: python replay_gate.py ANSWERS.jsonl CALIBRATION.json, where each line of ANSWERS holds ``prompt_ids`` and
``answer_ids`` (plain greedy decoding) and CALIBRATION is a file of ``~/.cache/dartspec/calibration/`` (the
machine's verify cost curve). Greedy verification accepts the longest tree path the answer follows, so the replay
needs no target; it prints each policy's median speed over answers relative to plain decoding on that curve.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dartspec.drafters.pld import LookupGate, PromptLookupDrafter, followed
from dartspec.tree import DraftBudget
from dartspec.tree_size import CostCurve


def curve_of(path: str) -> CostCurve:
    data = json.loads(Path(path).read_text())
    return CostCurve(tuple(data["qs"]), tuple(data["seconds"]))


def replay(rows: list[dict], curve: CostCurve, drafter: PromptLookupDrafter, nodes: int, depth: int = 8) -> np.ndarray:
    """Each answer's tokens per unit of modeled time (seconds of the curve)."""
    speeds = []
    for row in rows:
        prompt, answer = row["prompt_ids"], row["answer_ids"]
        drafter.begin(prompt)
        j, seconds = 1, 0.0  # the prefill commits the first answer token
        while j < len(answer):
            budget = DraftBudget(max_nodes=nodes, max_depth=min(depth, len(answer) - j - 1))
            tree = drafter.propose(prompt + answer[:j], budget)
            paths = [tree.tokens[p[1:]].tolist() for p in tree.paths()] if tree.size > 1 else []
            seconds += float(curve.cost(tree.size))
            j += followed(paths, answer[j:]) + 1
        speeds.append((len(answer) - 1) / seconds)
    return np.array(speeds)


def main(answers: str, calibration: str) -> None:
    rows = [json.loads(line) for line in Path(answers).read_text().splitlines()]
    curve = curve_of(calibration)
    base = replay(rows, curve, PromptLookupDrafter(), 1)
    policies: list[tuple[str, Callable[[], PromptLookupDrafter], int]] = [
        (f"{'gated' if gated else 'every span'} at {n} nodes", make, n)
        for n in (2, 4, 8, 16)
        for gated, make in (
            (False, PromptLookupDrafter),
            (True, lambda: PromptLookupDrafter(gate=LookupGate(curve))),
        )
    ]
    for label, make, nodes in policies:
        ratio = replay(rows, curve, make(), nodes) / base
        print(f"{label:22s} median {np.median(ratio):.3f}x  mean {ratio.mean():.3f}x  min {ratio.min():.3f}x")


if __name__ == "__main__":
    main(*sys.argv[1:3])
