"""The AMX-INT8 GEMM path against VNNI, in one process (2026-12-06, README.md here): needs the build that had
`dartspec_amx(int)` (not shipped: the tiles measured slower); kept to show how the numbers were taken."""

import statistics
import sys
import time

import numpy as np
import torch

from dartspec import exact
from dartspec.targets import load_target
from dartspec.tree import Tree

t = load_target("smollm2-135m")
lib = exact._library()
print("amx", lib.dartspec_amx(1))
rng = np.random.default_rng(0)
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 256
t.reset()
t.prefill(rng.integers(10, 40000, size=ctx).tolist())
base = t.cached
qs = [1, 2, 3, 4, 6, 8, 12, 16, 32]
# correctness: same logits with and without
for q in qs:
    tree = Tree.chain(7, rng.integers(10, 40000, size=q - 1).tolist())
    outs = []
    for on in (0, 1):
        lib.dartspec_amx(on)
        o = t.verify(tree)
        outs.append(o.logits.clone())
        t.truncate(base)
    print(q, "identical", torch.equal(outs[0], outs[1]), float((outs[0] - outs[1]).abs().max()))
S = {on: {q: [] for q in qs} for on in (0, 1)}
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 30):
    for on in (0, 1) if r % 2 else (1, 0):
        lib.dartspec_amx(on)
        for q in qs:
            tree = Tree.chain(7, rng.integers(10, 40000, size=q - 1).tolist())
            s = time.perf_counter()
            t.verify(tree)
            S[on][q].append(time.perf_counter() - s)
            t.truncate(base)
m = {on: {q: statistics.median(v) for q, v in S[on].items()} for on in S}
print("q      " + " ".join(f"{q:>7}" for q in qs))
for on in (0, 1):
    print(f"amx={on}  " + " ".join(f"{m[on][q] * 1e3:7.2f}" for q in qs))
print("ratio  " + " ".join(f"{m[1][q] / m[0][q]:7.3f}" for q in qs))
print("T(q)/T(1) vnni " + " ".join(f"{m[0][q] / m[0][1]:5.2f}" for q in qs))
print("T(q)/T(1) amx  " + " ".join(f"{m[1][q] / m[0][1]:5.2f}" for q in qs))
