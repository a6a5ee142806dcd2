"""Q5_0 blocks in 5 bits (kind 7) against 8 bits (kind 8), in one process, interleaved: every Q5_0 tensor of
Qwen2.5-Coder-0.5B's Q4_K_M file (388 M weights), 1, 2 and 4 input rows. The 8-bit form is the same weight with one
extra output row holding a Q8_0 group (which keeps the whole weight in 8 bits); its rows give the same results.

    python docs/bench/qwen-kquant-6bit-2026-11-27/ab_q5_0.py ~/.cache/dartspec/gguf/qwen2.5-coder-0.5b/*.gguf
"""

import sys
import time

import gguf
import numpy as np
import torch

from dartspec import exact

torch.set_num_threads(2)
reader = gguf.GGUFReader(sys.argv[1])
weights: dict[str, list[exact.ExactWeight]] = {"5 bits": [], "8 bits": []}
for t in reader.tensors:
    if t.tensor_type != gguf.GGMLQuantizationType.Q5_0 or len(t.shape) != 2:
        continue
    w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    extra = torch.zeros(1, w.shape[1])
    extra[0, 0], extra[0, 1] = 1.0, 1 / 127  # d = 1 / 127, q = 127 and 1: a Q8_0 group, no smaller form
    rows = exact.pack(torch.cat([w, extra]))
    assert rows is not None and rows.kind == 8
    weights["8 bits"].append(exact.to_panels(rows))
    five = exact.pack(w)
    assert five is not None
    weights["5 bits"].append(exact.to_panels(five))
    assert weights["5 bits"][-1].kind == 7
for rows in (1, 2, 4):
    x = torch.randn(rows, weights["5 bits"][0].in_features)
    a, b = weights["5 bits"][0], weights["8 bits"][0]
    assert torch.equal(exact.linear_a16(x, a), exact.linear_a16(x, b)[:, : a.out_features])  # bit for bit
    times: dict[str, list[float]] = {tag: [] for tag in weights}
    for i in range(20):
        for tag in list(weights)[:: 1 if i % 2 else -1]:
            start = time.perf_counter()
            for w in weights[tag]:
                exact.linear_a16(torch.randn(rows, w.in_features), w)
            times[tag].append(time.perf_counter() - start)
    ms = {tag: float(np.median(t)) * 1e3 for tag, t in times.items()}
    for tag in weights:
        mb = sum(w.nbytes for w in weights[tag]) / 1e6
        print(f"{rows} rows  {tag} {ms[tag]:6.2f} ms  {mb:6.1f} MB  {mb / ms[tag]:5.1f} GB/s")
    print(f"{rows} rows  time 5 bits / 8 bits: {ms['5 bits'] / ms['8 bits']:.2f}")
