"""Prefill time of SmolLM2 for 256-2,048 random tokens (best of 3), with the KV cache given: fp16 or fp32.

    .venv/bin/python docs/bench/fp16-kv-2026-12-07/prefill_curve.py fp16
"""
import time, statistics, sys
from dartspec.targets import load_target
t = load_target("smollm2-135m", kv_cache=sys.argv[1])
import numpy as np
rng = np.random.default_rng(0)
ids = rng.integers(100, 40000, size=2048).tolist()
t.prefill(ids[:64]); t.reset()
for n in (256, 512, 1024, 2048):
    ts = []
    for _ in range(3):
        t.reset(); t0 = time.perf_counter(); t.prefill(ids[:n]); ts.append(time.perf_counter() - t0)
    m = min(ts)
    print(f"{n}: {m:.3f} s, {n/m:.0f} tok/s, {m/n*1e3:.3f} ms/token")
