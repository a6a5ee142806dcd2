"""Prefill time of SmolLM2 for 512 and 2,048 random tokens (best of 3), one build per process (A/B with PYTHONPATH
pointing at a git worktree of the build before).

.venv/bin/python docs/bench/prefill-heads-2026-12-07/prefill_ab.py LABEL
"""

import sys
import time

import numpy as np

from dartspec.targets import load_target

target = load_target("smollm2-135m")
ids = np.random.default_rng(0).integers(100, 40000, size=2048).tolist()
target.prefill(ids[:64])
out = []
for n in (512, 2048):
    times = []
    for _ in range(3):
        target.reset()
        start = time.perf_counter()
        target.prefill(ids[:n])
        times.append(time.perf_counter() - start)
    out.append(f"{n}: {min(times):.3f}")
print(sys.argv[1], " ".join(out), flush=True)
