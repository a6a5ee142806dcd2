"""Prefill of 256 and 2,048 tokens over the fp32 and the fp16 KV cache, interleaved in one process (medians).

.venv/bin/python docs/bench/fp16-kv-2026-12-07/prefill_ab.py
"""

import statistics
import time

import numpy as np

from dartspec.targets import load_target

targets = {kv: load_target("smollm2-135m", kv_cache=kv) for kv in ("fp32", "fp16")}
ids = np.random.default_rng(0).integers(100, 40000, size=2048).tolist()
for target in targets.values():
    target.prefill(ids[:64])
for n in (256, 2048):
    seconds: dict[str, list[float]] = {kv: [] for kv in targets}
    for _ in range(5 if n == 256 else 3):
        for kv, target in targets.items():
            target.reset()
            start = time.perf_counter()
            target.prefill(ids[:n])
            seconds[kv].append(time.perf_counter() - start)
    medians = {kv: statistics.median(s) for kv, s in seconds.items()}
    print(n, {kv: round(m, 3) for kv, m in medians.items()}, "fp16/fp32", round(medians["fp16"] / medians["fp32"], 3))
