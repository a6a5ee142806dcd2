"""Q6_K's values in 6 bits against a byte each, in one process, interleaved: the fourteen Q6_K down projections of
Qwen2.5-Coder-1.5B's Q4_K_M file (158 MB in 6 bits, 206 MB in bytes), 1, 2 and 4 input rows.

The byte-a-value kernel is the package at commit c39b9ac, imported under another name:

    git worktree add /tmp/ab/old c39b9ac && mkdir -p /tmp/ab/oldpkg
    cp -r /tmp/ab/old/dartspec /tmp/ab/oldpkg/dartspec_old
    grep -rl dartspec /tmp/ab/oldpkg/dartspec_old --include=*.py | xargs sed -i 's/from dartspec\\b/from dartspec_old/g'
    python docs/bench/qwen-kquant-6bit-2026-11-27/ab_q6k.py /path/qwen2.5-coder-1.5b-q4_k_m.gguf /tmp/ab/oldpkg
"""

import sys
import time

import gguf
import numpy as np
import torch

sys.path.insert(0, sys.argv[2])
from dartspec_old import exact as exact_old
from dartspec_old import kquants as kquants_old

from dartspec import exact, kquants

torch.set_num_threads(2)
reader = gguf.GGUFReader(sys.argv[1])
raws = [t for t in reader.tensors if "ffn_down" in t.name and t.tensor_type == gguf.GGMLQuantizationType.Q6_K]
weights = {
    tag: [ex.to_panels(kq.q6_k_groups(np.asarray(t.data), 1536, 8960)) for t in raws]
    for tag, ex, kq in (("6 bits", exact, kquants), ("a byte", exact_old, kquants_old))
}
run = {"6 bits": exact.linear_a16, "a byte": exact_old.linear_a16}
for rows in (1, 2, 4):
    x = torch.randn(rows, 8960)
    assert torch.equal(run["6 bits"](x, weights["6 bits"][0]), run["a byte"](x, weights["a byte"][0]))  # bit for bit
    times: dict[str, list[float]] = {tag: [] for tag in weights}
    for i in range(30):
        for tag in list(weights)[:: 1 if i % 2 else -1]:
            start = time.perf_counter()
            for w in weights[tag]:
                run[tag](x, w)
            times[tag].append(time.perf_counter() - start)
    ms = {tag: float(np.median(t)) * 1e3 for tag, t in times.items()}
    for tag in weights:
        mb = sum(w.nbytes for w in weights[tag]) / 1e6
        print(f"{rows} rows  {tag:7s} {ms[tag]:6.2f} ms  {mb:6.1f} MB  {mb / ms[tag]:5.1f} GB/s")
    print(f"{rows} rows  time 6 bits / a byte: {ms['6 bits'] / ms['a byte']:.2f}")
