"""DART's share of a 4-node ``dart+pld`` tree on a CPU: 2 or 3 nodes, or sized per step by the cost curve.

Usage: python ab_share.py [FIRST LAST] (dev80.jsonl prompts FIRST..LAST-1; default all 80). Every prompt is decoded
greedily (128 new tokens) by each variant in one process, in an order rotating by prompt; prints the median and IQR
of each variant's speed over plain decoding's on the same prompt, and its median tau (``dev80-ab.txt``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from dartspec.engine import Generator
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target
from dartspec.tree_size import auto_sizer

DEV80 = Path(__file__).resolve().parent.parent / "cpu-default-dart-pld-2026-11-26" / "dev80.jsonl"


def hybrid(target, draft_nodes: int, sized: bool = False) -> Generator:
    gen = build_generator(target, GeneratorSpec(drafter="dart+pld", tree_size=4, draft_nodes=draft_nodes))
    if sized:  # DART's tree cut per step by the machine's cost curve, inside the spans' leftover
        gen.drafter.drafter.auto = auto_sizer(target, True)
    return gen


def main(first: int = 0, last: int = 80) -> None:
    target = load_target("smollm2-135m")
    prompts = [json.loads(line)["prompt"] for line in DEV80.read_text().splitlines()][first:last]
    gens = {
        "ar": build_generator(target, GeneratorSpec()),
        "d2": hybrid(target, 2),
        "d3": hybrid(target, 3),
        "s4": hybrid(target, 4, sized=True),
    }
    for gen in gens.values():  # warm-up: kernels, buffers, the calibration
        gen.generate(prompts[0], chat=True, max_new_tokens=8)
    speed: dict[str, list[float]] = {k: [] for k in gens}
    taus: dict[str, list[float]] = {k: [] for k in gens}
    names = list(gens)
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            result = gens[name].generate(prompt, chat=True, max_new_tokens=128)
            speed[name].append(len(result.token_ids) / (time.perf_counter() - start))
            taus[name].append(result.stats.tau)
    base = np.array(speed["ar"])
    for name in gens:
        ratio = np.array(speed[name]) / base
        q1, q3 = np.percentile(ratio, [25, 75])
        print(f"{name:4s} median {np.median(ratio):.3f}x IQR {q1:.2f}-{q3:.2f} tau {np.median(taus[name]):.2f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
