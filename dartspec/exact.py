"""The ``exact`` weight format: integer weight groups that reproduce the fp32 weights bit for bit.

Models that come from GGUF files (every model dartspec knows) were quantized once by their publisher:
SmolLM2's layers are Q4_1 blocks (each group of 32 weights is ``d * q + m`` with a 4-bit q) and its
embedding / LM head is Q8_0 (``d * q`` with an int8 q). Dequantized to fp32 they are exactly such groups,
so storing the integers and the per-group d, m loses nothing: 5-9 bits per weight instead of 32, the
same numbers. :func:`pack` finds the groups and checks every weight; the GEMM (``qgemm.c``, compiled
once per machine with the system C compiler) widens them to fp32 in registers and does all arithmetic in
fp32, so the result differs from a dense fp32 GEMM only in summation order (like any other GEMM kernel).

On a memory-bound CPU decode step this is the difference: SmolLM2's linear weights are 540 MB in fp32,
270 MB in fp16 and 112 MB here.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from dartspec.errors import DartspecError

GROUP = 32
_SOURCE = Path(__file__).with_name("qgemm.c")


@dataclass(frozen=True)
class ExactWeight:
    """A weight matrix as integer groups: ``kind`` 4 (``d * q + m``, nibbles) or 8 (``d * q``, int8)."""

    kind: int
    data: torch.Tensor  # uint8 (O, G, 16) for kind 4, int8 (O, G, 32) for kind 8
    scale: torch.Tensor  # float32 (O, G)
    offset: torch.Tensor | None  # float32 (O, G) for kind 4
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        extra = self.offset.nbytes if self.offset is not None else 0
        return self.data.nbytes + self.scale.nbytes + extra


def pack(weight: torch.Tensor) -> ExactWeight | None:
    """The exact integer-group form of ``weight`` (4-bit if every group allows it, else 8-bit), or None when
    some weight is not reproduced exactly."""
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    out, k = w.shape
    if k % GROUP:
        return None
    g = w.reshape(out, k // GROUP, GROUP)
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    # 4-bit: the group's minimum is m (q = 0) and its maximum m + 15 d (q = 15).
    d = (high - low) / 15
    q = torch.where(d > 0, (g - low) / torch.where(d > 0, d, 1), 0).round()
    if bool((q.clamp(0, 15) * d + low == g).all()):
        q = q.to(torch.uint8).reshape(out, k // GROUP, GROUP)
        nibbles = q[..., :16] | (q[..., 16:] << 4)
        return ExactWeight(4, nibbles.contiguous(), d[..., 0].contiguous(), low[..., 0].contiguous(), out, k)
    # 8-bit symmetric: the largest magnitude is 127 d.
    d = g.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, g / torch.where(d > 0, d, 1), 0).round()
    if bool((q.abs() <= 127).all()) and bool((q * d == g).all()):
        return ExactWeight(8, q.to(torch.int8).contiguous(), d[..., 0].contiguous(), None, out, k)
    return None


def unpack(packed: ExactWeight) -> torch.Tensor:
    """The fp32 weights back (tests)."""
    if packed.kind == 4:
        q = torch.cat([packed.data & 15, packed.data >> 4], dim=-1).float()
        assert packed.offset is not None
        w = q * packed.scale[..., None] + packed.offset[..., None]
    else:
        w = packed.data.float() * packed.scale[..., None]
    return w.reshape(packed.out_features, packed.in_features)


def linear(x: torch.Tensor, packed: ExactWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` for ``x`` of shape ``(rows, in)`` in float32 on CPU."""
    lib = _library()
    x = x.contiguous()
    y = torch.empty((x.shape[0], packed.out_features), dtype=torch.float32)
    lib.dartspec_qgemm(
        packed.kind,
        x.data_ptr(),
        x.shape[0],
        packed.in_features,
        packed.data.data_ptr(),
        packed.scale.data_ptr(),
        packed.offset.data_ptr() if packed.offset is not None else None,
        bias.data_ptr() if bias is not None else None,
        y.data_ptr(),
        packed.out_features,
    )
    return y


def available() -> bool:
    """Whether the kernel can be built or loaded here (an x86-64 CPU with AVX2 and FMA, and a C compiler)."""
    try:
        _library()
    except DartspecError:
        return False
    return True


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    from dartspec.assets import cache_dir

    flags = _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma", "f16c"} <= flags:
        raise DartspecError("--quant exact needs an x86-64 CPU with AVX2 and FMA: use --quant fp16")
    source = _SOURCE.read_bytes()
    gomp = _torch_libgomp()
    key = hashlib.sha256(source + str(sorted(flags)).encode() + str(gomp).encode()).hexdigest()[:16]
    lib_path = cache_dir() / "kernels" / f"qgemm-{key}.so"
    if not lib_path.is_file():
        compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
        if compiler is None:
            raise DartspecError("--quant exact compiles a small C kernel once and needs gcc: use --quant fp16")
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib_path.with_name(f".{lib_path.name}.{os.getpid()}.tmp")
        cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(_SOURCE), "-o", str(tmp)]
        if gomp is not None:  # share torch's OpenMP runtime and thread pool instead of starting a second one
            cmd += [f"-Wl,-rpath,{gomp.parent}", str(gomp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            raise DartspecError(f"compiling the exact-format kernel failed ({first}): use --quant fp16")
        tmp.replace(lib_path)
    lib = ctypes.CDLL(str(lib_path))
    fn = lib.dartspec_qgemm
    fn.restype = None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    fn.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    return lib


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _torch_libgomp() -> Path | None:
    found = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    return found[0] if found else None
