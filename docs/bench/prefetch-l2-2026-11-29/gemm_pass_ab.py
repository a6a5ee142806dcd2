"""Interleaved A/B of builds of the C kernels with other -D flags: a pass over every linear of a model (a decode
step's weights, so none is still in the last-level cache when it comes round again) per build, ROWS input rows,
rotating order; median ms a pass. Run at commit 3acbb0a (PREFETCH_HINT, then a -D of qdot.c):

    python docs/bench/prefetch-l2-2026-11-29/gemm_pass_ab.py qwen2.5-coder-1.5b nta=-DPREFETCH_HINT=0 \
        none=-DPREFETCH_HINT=0,-DNO_PREFETCH l2=-DPREFETCH_HINT=2

The first session's variants (a -DPF_PANELS / -DPF_BYTES distance, since dropped: 1, 2 or 4 panels ahead or 4-8 KB
ahead in the same panel measured alike) are in prefetch_ab.txt.
"""

import collections
import ctypes
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from dartspec import exact
from dartspec.targets import load_target

torch.set_num_threads(2)
variants = dict(v.split("=", 1) for v in sys.argv[2:])  # name=-DFOO=1,-DBAR=2
gomp = exact._torch_libgomp()
libs = {}
for name, defs in variants.items():
    out = f"{tempfile.mkdtemp()}/lib_{name}.so"
    cmd = [
        "gcc",
        "-O3",
        "-march=native",
        "-fopenmp",
        "-shared",
        "-fPIC",
        *[d for d in defs.split(",") if d],
        *map(str, exact._SOURCES),
        "-o",
        out,
        f"-Wl,-rpath,{gomp.parent}",
        str(gomp),
    ]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(out)
    lib.dartspec_qdot.restype = None
    lib.dartspec_qdot.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        *[ctypes.c_void_p] * 1,
        ctypes.c_long,
        ctypes.c_long,
        *[ctypes.c_void_p] * 5,
        ctypes.c_long,
    ]
    libs[name] = lib
t = load_target(sys.argv[1])
ws = []
for L in t.layers:
    for nm in ("qkv", "o", "gate_up", "down"):
        ws += exact.parts(getattr(L, nm).packed)
ws.append(t._head.packed)
rows = int(__import__("os").environ.get("ROWS", "1"))
x = torch.randn(rows, max(w.in_features for w in ws))
ys = {w.out_features: torch.empty(rows, w.out_features) for w in ws}
xs = {w.in_features: torch.randn(rows, w.in_features) for w in ws}


def run(lib):
    for w in ws:
        lib.dartspec_qdot(
            w.kind,
            exact._half(w),
            xs[w.in_features].data_ptr(),
            rows,
            w.in_features,
            w.data.data_ptr(),
            w.scale.data_ptr(),
            w.offset.data_ptr() if w.offset is not None else None,
            None,
            ys[w.out_features].data_ptr(),
            w.out_features,
        )


mb = sum(w.nbytes for w in ws) / 1e6
times = collections.defaultdict(list)
names = list(libs)
for i in range(int(__import__("os").environ.get("ITERS", "12"))):
    order = names[i % len(names) :] + names[: i % len(names)]
    for n in order:
        s = time.perf_counter()
        run(libs[n])
        times[n].append(time.perf_counter() - s)
base = np.median(times[names[0]])
for n in names:
    m = np.median(times[n])
    print(f"{n:14s} {m * 1e3:7.1f} ms  {mb / m / 1e3:5.1f} GB/s  {m / base:.3f}x time of {names[0]}")
