"""Prefill of 256 and 2,048 tokens over the fp32 and the fp16 KV cache, interleaved in one process (medians).

    .venv/bin/python docs/bench/fp16-kv-2026-12-07/prefill_ab.py
"""
import time, statistics
import numpy as np
from dartspec.targets import load_target
ts = {"fp32": load_target("smollm2-135m", kv_cache="fp32"), "fp16": load_target("smollm2-135m", kv_cache="fp16")}
ids = np.random.default_rng(0).integers(100, 40000, size=2048).tolist()
for t in ts.values(): t.prefill(ids[:64]); t.reset()
for n in (256, 2048):
    res = {k: [] for k in ts}
    for r in range(5 if n == 256 else 3):
        for k, t in ts.items():
            t.reset(); t0 = time.perf_counter(); t.prefill(ids[:n]); res[k].append(time.perf_counter() - t0)
    print(n, {k: round(statistics.median(v), 3) for k, v in res.items()}, "fp16/fp32", round(statistics.median(res["fp16"]) / statistics.median(res["fp32"]), 3))
