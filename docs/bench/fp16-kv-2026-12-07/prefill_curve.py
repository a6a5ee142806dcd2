"""Prefill time of SmolLM2 for 256-2,048 random tokens (best of 3), with the KV cache given: fp16 or fp32.

.venv/bin/python docs/bench/fp16-kv-2026-12-07/prefill_curve.py fp16
"""

import sys
import time

import numpy as np

from dartspec.targets import load_target

target = load_target("smollm2-135m", kv_cache=sys.argv[1])
ids = np.random.default_rng(0).integers(100, 40000, size=2048).tolist()
target.prefill(ids[:64])
for n in (256, 512, 1024, 2048):
    times = []
    for _ in range(3):
        target.reset()
        start = time.perf_counter()
        target.prefill(ids[:n])
        times.append(time.perf_counter() - start)
    best = min(times)
    print(f"{n}: {best:.3f} s, {n / best:.0f} tok/s, {best / n * 1e3:.3f} ms/token")
