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

The ``exact-a16`` format keeps the same integers but rounds each group of 32 activations to 16-bit integers
(1/32767 of the group's largest magnitude), so that a group's products are one exact integer dot product
(``qdot.c``: AVX-512 VNNI or AVX2 ``madd``) instead of fp32 multiply-adds on widened weights: 1.3x faster for
one token and 1.9x for 16 rows on SmolLM2, and it passes the fidelity gate (README). Its weights are laid out
in panels of 8 or 16 outputs (:func:`to_panels`), with each group's d and m in fp16 where they are half-precision
numbers (a GGUF's Q4_1 / Q8_0 blocks store them so; SmolLM2: 96 MB a step instead of 111, the same numbers).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dartspec.atomic import atomic_path
from dartspec.errors import DartspecError

GROUP = 32
_SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("qgemm.c", "qdot.c", "attend.c", "block.c", "ngram.c", "search.c")
)
_HEADERS = tuple(Path(__file__).with_name(name) for name in ("rows.h", "qdot.h", "vmath.h", "ngram.h"))


@dataclass(frozen=True)
class ExactWeight:
    """A weight matrix as integer groups: ``kind`` 4 (``d * q + m``, nibbles) or 8 (``d * q``, int8); kinds 5 (``d * q
    + m``, uint8: a GGUF's Q5_K blocks) and 6 (int8 groups of values -32..31 whose halves of 16 have a scale each: Q6_K
    blocks, scale (O, G, 2); 6 bits a value in panels), read from the file (:mod:`dartspec.kquants`), for the
    integer-dot kernel only; or kind 16, fp16 weights in panels (:func:`half_panels`, no scales), for the weights beside
    them that are no groups.

    ``panel`` 0: one row per output (``qgemm.c``): data uint8 (O, G, 16) / int8 (O, G, 32), scale and offset
    (O, G). ``panel`` P > 0: the integer-dot kernel's panels of P outputs (``qdot.c``, :func:`to_panels`); there
    8-bit groups whose values fit 5 bits (a GGUF's Q5_0 and Q4_0 blocks) are kind 7, the same numbers in 5 bits.

    ``codes``: for a Q4_K or Q6_K weight (rows layout), the file's own form of its scales (and offsets) beside their
    fp32 values: Q4_K uint8 (O, G, 2), each group's 6-bit scale and minimum codes, and fp16 (O, G / 8, 2), each
    super-block's ``d`` and ``-dmin`` (scale = d * code, offset = -dmin * code, exact in fp32); Q6_K int8 (O, G, 2),
    each half group's scale code, and fp16 (O, G / 8, 1), each super-block's ``d``. :func:`to_panels` lays them out
    for the kernel (scale: the codes (P, G, 2, panel); offset: the super-block numbers (P, G / 8, n, panel)): 18.5
    bytes a Q4_K group instead of 24, 26.25 a Q6_K group (with its values in 6 bits) instead of 32.

    ``rest``: a fused projection whose parts are groups of different kinds (:func:`stack`; a Q4_K_M file's Q4_K query
    and key beside a Q6_K value) is a chain: this weight's own fields hold its first ``out_features -
    rest.out_features`` outputs, ``rest`` the others; ``out_features`` counts them all. The integer-dot kernel runs
    each part into its columns.
    """

    kind: int
    data: torch.Tensor
    scale: torch.Tensor  # float32; in panels float16 where every scale and offset is a half-precision number
    offset: torch.Tensor | None  # as scale, kind 4 only
    out_features: int
    in_features: int
    panel: int = 0
    codes: tuple[torch.Tensor, torch.Tensor] | None = None
    rest: ExactWeight | None = None

    @property
    def nbytes(self) -> int:
        extra = self.offset.nbytes if self.offset is not None else 0
        return self.data.nbytes + self.scale.nbytes + extra + (self.rest.nbytes if self.rest is not None else 0)


def parts(packed: ExactWeight) -> list[ExactWeight]:
    """The parts of a chain (:attr:`ExactWeight.rest`) as weights of their own; ``[packed]`` for one part."""
    if packed.rest is None:
        return [packed]
    own = dataclasses.replace(packed, out_features=packed.out_features - packed.rest.out_features, rest=None)
    return [own, *parts(packed.rest)]


def chain(weights: Sequence[ExactWeight]) -> ExactWeight:
    """Weights of one input width stacked along outputs as a chain (:attr:`ExactWeight.rest`), without copying."""
    *head, last = weights
    for w in reversed(head):
        last = dataclasses.replace(w, out_features=w.out_features + last.out_features, rest=last)
    return last


def pack(weight: torch.Tensor) -> ExactWeight | None:
    """The exact integer-group form of ``weight`` (4-bit if every group allows it, else 8-bit), or None when
    some weight is not reproduced exactly."""
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    out, k = w.shape
    if k % GROUP:
        return None
    g = w.reshape(out, k // GROUP, GROUP)
    # A sample of rows first: where it is no 4-bit groups neither is the weight (each test is a few passes over
    # the whole weight: a 0.5B model's first load packs ~500 M weights).
    if _four_bit(g[:_SAMPLE_ROWS]) is not None and (four := _four_bit(g)) is not None:
        q, d, low = four
        q = q.to(torch.uint8).reshape(out, k // GROUP, GROUP)
        nibbles = q[..., :16] | (q[..., 16:] << 4)
        return ExactWeight(4, nibbles.contiguous(), d[..., 0].contiguous(), low[..., 0].contiguous(), out, k)
    found = _symmetric_groups(g.reshape(-1, GROUP))
    if found is None:
        return None
    q, d = found
    return ExactWeight(8, q.reshape(out, k // GROUP, GROUP), d.reshape(out, k // GROUP), None, out, k)


_SAMPLE_ROWS = 16


def _four_bit(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(q, d, m)`` of 4-bit groups ``d * q + m`` equal to ``g`` (..., GROUP), or None: the group's minimum is m
    (q = 0) and its maximum m + 15 d (q = 15), as a GGUF's Q4_1 blocks have them."""
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d = (high - low) / 15
    q = torch.where(d > 0, (g - low) / torch.where(d > 0, d, 1), 0).round()
    return (q, d, low) if bool((q.clamp(0, 15) * d + low == g).all()) else None


#: The largest |q| an 8-bit symmetric group may have, in the order :func:`_symmetric_groups` tries them: 127 (a
#: GGUF's Q8_0 blocks), then 16 down to 1 (Q5_0 blocks are ``d * (q - 16)`` with a 5-bit q: the largest magnitude is
#: at most 16 d).
_LARGEST_Q = (127, *range(16, 0, -1))


def _try_order(seen: torch.Tensor) -> tuple[int, ...]:
    """:data:`_LARGEST_Q` ordered by how many of a sample's groups had each largest |q| (``seen``), most first; ties
    (and values the sample lacked) keep their order."""
    counts = {n: int((seen == n).sum()) for n in _LARGEST_Q}
    return tuple(sorted(_LARGEST_Q, key=lambda n: -counts[n]))


def _symmetric_groups(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q int8, d)`` with ``q * d == g`` exactly for every group (row) of ``g``, or None. A group whose largest
    |q| is n has ``d = max|g| / n`` (exact: the quotient of an exact product), so each n is tried on the groups still
    unsolved; a tensor of other numbers fails the first two tries on every group and is given up at once. A sample
    of groups is solved first: where it fails the whole fails, else its largest |q| values, most frequent first, set
    the order of the tries on the whole (a Q5_0 weight's 16 and 15 before 127)."""
    amax = g.abs().amax(-1, keepdim=True)
    order = _LARGEST_Q
    sample = _SAMPLE_ROWS * 32  # groups
    if len(g) > sample:
        found = _symmetric_groups(g[:sample])
        if found is None:
            return None
        order = _try_order((amax[:sample, 0] / torch.where(found[1] > 0, found[1], 1)).round())
    q = torch.zeros(g.shape, dtype=torch.int8)
    d = torch.zeros(amax.shape)
    todo = torch.nonzero(amax[:, 0] > 0)[:, 0]  # all-zero groups: d = 0, q = 0
    for tries, n in enumerate(order):
        if len(todo) == 0:
            return q, d[:, 0]
        if tries == 2 and len(todo) == len(amax):  # neither Q8_0 nor Q5_0: not worth 15 more passes
            return None
        dn = amax[todo] / n
        qn = (g[todo] / dn).round()
        ok = ((qn.abs() <= 127) & (qn * dn == g[todo])).all(-1)
        q[todo[ok]], d[todo[ok]] = qn[ok].to(torch.int8), dn[ok]
        todo = todo[~ok]
    return (q, d[:, 0]) if len(todo) == 0 else None


def quantize8(weight: torch.Tensor) -> ExactWeight:
    """``weight`` rounded to 8-bit groups (``d * q``, d = the group's largest magnitude / 127): a lossy copy, for
    networks whose exact values matter little (drafters: their proposals are verified, never trusted)."""
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    out, k = w.shape
    if k % GROUP:
        raise ValueError(f"quantize8 needs rows of whole groups of {GROUP} (got {k})")
    g = w.reshape(out, k // GROUP, GROUP)
    d = g.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, g / torch.where(d > 0, d, 1), 0).round().clamp(-127, 127)
    return ExactWeight(8, q.to(torch.int8).contiguous(), d[..., 0].contiguous(), None, out, k)


def unpack(packed: ExactWeight) -> torch.Tensor:
    """The fp32 weights back (tests)."""
    if packed.rest is not None:
        return torch.cat([unpack(p) for p in parts(packed)])
    if packed.kind == 4:
        q = torch.cat([packed.data & 15, packed.data >> 4], dim=-1).float()
        assert packed.offset is not None
        w = q * packed.scale[..., None] + packed.offset[..., None]
    elif packed.kind == 6:
        halves = packed.data.float().reshape(*packed.data.shape[:-1], 2, GROUP // 2)
        w = halves * packed.scale[..., None]
    elif packed.kind == 5:
        assert packed.offset is not None
        w = packed.data.float() * packed.scale[..., None] + packed.offset[..., None]
    else:
        w = packed.data.float() * packed.scale[..., None]
    return w.reshape(packed.out_features, packed.in_features)


def map_rows(packed: ExactWeight, rows: Callable[[torch.Tensor], torch.Tensor]) -> ExactWeight:
    """``packed`` (rows layout) with its outputs reordered by ``rows``, a function of a tensor's first dimension
    (e.g. :func:`dartspec.rotary.interleave_rows`), applied alike to data, scales and offsets."""
    if packed.rest is not None:
        raise ValueError("map_rows takes one part, not a chain")
    offset = None if packed.offset is None else rows(packed.offset)
    codes = None if packed.codes is None else (rows(packed.codes[0]), rows(packed.codes[1]))
    return dataclasses.replace(packed, data=rows(packed.data), scale=rows(packed.scale), offset=offset, codes=codes)


def concat(parts: Sequence[ExactWeight]) -> ExactWeight | None:
    """Weights (rows layout) stacked along outputs, as one fused projection; None unless they are groups of one kind
    with the same inputs and scales of one type."""
    first = parts[0]
    same = all(
        p.kind == first.kind
        and p.in_features == first.in_features
        and not p.panel
        and p.rest is None
        and p.scale.dtype == first.scale.dtype
        and (p.offset is None) == (first.offset is None)
        for p in parts
    )
    if not same:
        return None
    if len(parts) == 1:
        return first
    offset = None if first.offset is None else torch.cat([p.offset for p in parts])  # type: ignore[misc]
    out = sum(p.out_features for p in parts)
    data, scale = torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts])
    codes = None  # the compact form where every part has it; the fp32 scales alone are the same numbers
    if all(p.codes is not None for p in parts):
        codes = (torch.cat([p.codes[0] for p in parts]), torch.cat([p.codes[1] for p in parts]))  # type: ignore[index]
    return ExactWeight(first.kind, data, scale, offset, out, first.in_features, codes=codes)


def stack(weights: Sequence[ExactWeight]) -> ExactWeight | None:
    """Weights (rows layout) stacked along outputs as one fused projection for the integer-dot kernel: each run of
    parts of one kind concatenated (:func:`concat`), runs of different kinds chained (:attr:`ExactWeight.rest`); None
    unless all have the same inputs."""
    if any(w.in_features != weights[0].in_features or w.rest is not None for w in weights):
        return None
    runs: list[ExactWeight] = []
    for w in weights:
        joined = concat([runs[-1], w]) if runs else None
        if joined is not None:
            runs[-1] = joined
        else:
            runs.append(w)
    return chain(runs)


def linear(x: torch.Tensor, packed: ExactWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` for ``x`` of shape ``(rows, in)`` in float32 on CPU (``packed`` in rows)."""
    if packed.kind not in (4, 8):
        raise ValueError(f"the exact format's kernel takes 4- and 8-bit groups, not kind {packed.kind}")
    return _gemm(_library().dartspec_qgemm, (packed.kind,), x, packed, bias)


def _gemm(
    kernel: Any, lead: tuple[int, ...], x: torch.Tensor, packed: ExactWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """Call one of the C GEMMs (the same signature after its ``lead`` arguments: the format's kind, and for the
    integer-dot kernel whether its scales are fp16) on ``x`` made contiguous fp32 (the kernels read float32 rows: a
    half-precision tensor, e.g. from an op under autocast, would otherwise be read past its end)."""
    x = x.to(torch.float32).contiguous()
    y = torch.empty((x.shape[0], packed.out_features), dtype=torch.float32)
    kernel(
        *lead,
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


def to_panels(packed: ExactWeight, panel: int | None = None) -> ExactWeight:
    """Lay ``packed`` (rows) out in panels of ``panel`` outputs (default: the kernel's width on this CPU)."""
    panel = panel or kernel_panel()
    if packed.rest is not None:
        return chain([to_panels(p, panel) for p in parts(packed)])
    out, k = packed.out_features, packed.in_features
    groups = k // GROUP
    blocks = -(-out // panel)
    pad = blocks * panel - out

    def panels(t: torch.Tensor) -> torch.Tensor:  # (O, G, ...) -> (P, G, panel, ...)
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t
        return t.reshape(blocks, panel, groups, *t.shape[2:]).transpose(1, 2)

    kind, values, scales = packed.kind, packed.data, packed.scale
    if kind == 8 and (five := _five_bit_groups(packed)) is not None:
        kind, values, scales = 7, *five  # a GGUF's Q5_0 and Q4_0 blocks: the same numbers in 5 bits (qdot.c)
    if kind == 4:
        q = panels(torch.cat([packed.data & 15, packed.data >> 4], dim=-1))  # (P, G, panel, 32)
        q = q.reshape(blocks, groups, panel, 2, 8, 2)  # halves of the group, chunk c, pair element e
        data = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 1, 3, 2, 4)  # (P, G, c, panel, e)
        offset = panels(packed.offset).contiguous() if packed.offset is not None else None
    elif kind in (6, 7):  # 6 (Q6_K) or 5 bits a weight, as the file keeps them: stored as q + 32 (q + 16)
        bias = 32 if kind == 6 else 16
        q = panels(values).to(torch.int16) + bias
        if bool(((q < 0) | (q >= 2 * bias)).any()):
            raise ValueError(f"kind-{kind} groups hold values in {-bias}..{bias - 1}")
        data, offset = _nibbles_and_high_bits(q.to(torch.uint8), 2 if kind == 6 else 1), None
    else:
        data = panels(packed.data).reshape(blocks, groups, panel, 16, 2).permute(0, 1, 3, 2, 4)
        offset = panels(packed.offset).contiguous() if packed.offset is not None else None
    if packed.codes is not None:  # a K-quant weight in the file's own form (half 2 in qdot.c)
        codes, numbers = (torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) for t in packed.codes)
        scale = codes.reshape(blocks, panel, groups, 2).permute(0, 2, 3, 1).contiguous()  # (P, G, 2, panel)
        per_block = numbers.shape[-1]
        offset = numbers.reshape(blocks, panel, groups // 8, per_block).permute(0, 2, 3, 1).contiguous()
        return ExactWeight(packed.kind, data.reshape(blocks, groups, -1).contiguous(), scale, offset, out, k, panel)
    if packed.kind in (5, 6):  # fp32 scales (the K-quants' products d * sc are no fp16 numbers)
        # kind 6: a scale per half group, (P, G, 2, panel)
        scale = panels(packed.scale).permute(0, 1, 3, 2) if packed.kind == 6 else panels(packed.scale)
        data = data.reshape(blocks, groups, -1).contiguous()
        return ExactWeight(packed.kind, data, scale.contiguous(), offset, out, k, panel)
    scale = panels(scales).contiguous()
    # A decode step is bound by reading weights: where every scale and offset is a half-precision number (a GGUF's
    # Q4_1 and Q8_0 blocks store them so), keep them in fp16 (a 4-bit group 20 bytes instead of 24, the same numbers).
    if all(t is None or torch.equal(t.half().float(), t) for t in (scale, offset)):
        scale, offset = scale.half(), None if offset is None else offset.half()
    return ExactWeight(kind, data.reshape(blocks, groups, -1).contiguous(), scale, offset, out, k, panel)


def _five_bit_groups(packed: ExactWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The values (in -16..15) and scales of 8-bit groups that fit 5 bits, or None. A Q5_0 block is ``d * (q - 16)``
    with a 5-bit q and a d of either sign, so a group's values reach -16 or, with d < 0, +16 (the packer's d is
    positive): such a group is negated, values and scale (the same products, bit for bit)."""
    top, bottom = packed.data.amax(-1), packed.data.amin(-1)
    flip = top == 16
    if not bool(((bottom >= -16) & (top <= 15) | flip & (bottom >= -15)).all()):
        return None
    return torch.where(flip[..., None], -packed.data, packed.data), torch.where(flip, -packed.scale, packed.scale)


def _nibbles_and_high_bits(q: torch.Tensor, high: int) -> torch.Tensor:
    """Kinds 6 and 7's panel data (qdot.c) from unsigned values ``q`` ``(P, G, panel, 32)`` of ``4 + high`` bits: their
    low 4 bits as kind 4's nibbles (chunk c: inputs 2c + e and 16 + 2c + e), then their high bits, ``4 / high``
    chunks sharing a byte: the value of half h in the k-th chunk of a byte at bit ``high * (h + 2k)``."""
    blocks, groups, panel = q.shape[:3]
    pairs = q.reshape(blocks, groups, panel, 2, 8, 2)  # half h, chunk c, pair element e
    low = (pairs[:, :, :, 0] & 15) | ((pairs[:, :, :, 1] & 15) << 4)  # (P, G, panel, c, e)
    per = 4 // high  # chunks whose high bits share a byte
    tops = (pairs >> 4).reshape(blocks, groups, panel, 2, 8 // per, per, 2)  # h, byte chunk j, k, e
    shifts = high * (torch.arange(2)[:, None] + 2 * torch.arange(per)[None, :])  # (h, k)
    bits = (tops << shifts.to(torch.uint8).reshape(2, 1, per, 1)).sum(dim=(3, 5), dtype=torch.uint8)  # no overlaps
    chunks = [t.permute(0, 1, 3, 2, 4).reshape(blocks, groups, -1) for t in (low, bits)]  # (P, G, c or j, panel, e)
    return torch.cat(chunks, dim=-1)


def _half(packed: ExactWeight) -> int:
    """1 where ``packed``'s scales (and offsets) are fp16, 0 where fp32, 2 where they are a K-quant weight's codes (the
    C kernels' ``half`` flag)."""
    return 2 if packed.scale.dtype in (torch.uint8, torch.int8) else int(packed.scale.dtype == torch.float16)


def half_panels(weight: torch.Tensor, panel: int | None = None) -> ExactWeight:
    """``weight`` rounded to fp16 in panels of ``panel`` outputs (kind 16: ``qdot.c`` widens them and runs fp32 FMAs
    on unrounded inputs, every row on its own): the ``fp16`` format on dartspec's kernels, and the weights of an
    exact-a16 model that are no integer groups (a model not from a GGUF file, other block types), in the same fused
    blocks."""
    panel = panel or kernel_panel()
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    out, k = w.shape
    blocks = -(-out // panel)
    w = torch.cat([w, w.new_zeros((blocks * panel - out, k))]) if blocks * panel > out else w
    data = w.half().reshape(blocks, panel, k).transpose(1, 2).contiguous()  # (P, K, panel): input k's panel outputs
    return ExactWeight(16, data, torch.zeros(0, dtype=torch.float16), None, out, k, panel)


def kernel_panel() -> int:
    """Outputs per panel of the integer-dot kernel on this CPU (16 with AVX-512, 8 with AVX2)."""
    return int(_library().dartspec_qdot_panel())


def to_tensors(packed: ExactWeight) -> dict[str, torch.Tensor]:
    """``packed`` as named tensors (the on-disk cache of :mod:`dartspec.weight_cache`); a chain's part i > 0 has its
    names suffixed ``@i``."""
    out = {}
    for i, p in enumerate(parts(packed)):
        meta = torch.tensor([p.kind, p.out_features, p.in_features, p.panel])
        fields = {"meta": meta, "data": p.data, "scale": p.scale, "offset": p.offset}
        out.update({f"{k}@{i}" if i else k: v for k, v in fields.items() if v is not None})
    return out


def from_tensors(tensors: dict[str, torch.Tensor]) -> ExactWeight:
    """The inverse of :func:`to_tensors`; ``ValueError`` (or ``KeyError``) when the tensors do not form a packed
    weight."""
    count = 1 + sum(k.startswith("meta@") for k in tensors)
    found = [_part({k.removesuffix(f"@{i}"): v for k, v in tensors.items() if _part_of(k) == i}) for i in range(count)]
    if any(p.in_features != found[0].in_features or p.panel != found[0].panel for p in found):
        raise ValueError("inconsistent packed weight")
    return chain(found)


def _part_of(name: str) -> int:
    """The chain part a tensor name of :func:`to_tensors` belongs to."""
    index = name.partition("@")[2]
    return int(index) if index else 0  # ValueError for another suffix


def _part(tensors: dict[str, torch.Tensor]) -> ExactWeight:
    kind, out, k, panel = (int(v) for v in tensors["meta"].tolist())
    data, scale, offset = tensors["data"], tensors["scale"], tensors.get("offset")
    rows = -(-out // panel) * panel if panel else out
    if kind == 16:  # fp16 panels (half_panels)
        if not panel or data.dtype != torch.float16 or data.numel() != rows * k or scale.numel() or offset is not None:
            raise ValueError("inconsistent packed weight")
        return ExactWeight(kind, data, scale, offset, out, k, panel)
    per_group = {4: GROUP // 2, 6: GROUP * 3 // 4 if panel else GROUP, 7: GROUP * 5 // 8}.get(kind, GROUP)  # bytes
    coded = {4: torch.uint8, 6: torch.int8}
    if scale.dtype == coded.get(kind):  # a K-quant weight's codes and super-block numbers (to_panels)
        groups = rows * k // GROUP
        if (
            not panel
            or k % (8 * GROUP)
            or data.dtype != torch.uint8
            or data.numel() != groups * per_group
            or scale.numel() != groups * 2
            or offset is None
            or offset.dtype != torch.float16
            or offset.numel() != groups // 8 * (2 if kind == 4 else 1)
        ):
            raise ValueError("inconsistent packed weight")
        return ExactWeight(kind, data, scale, offset, out, k, panel)
    scales = 2 if kind == 6 else 1
    if (
        kind not in (4, 5, 6, 7, 8)
        or (kind == 7 and not panel)
        or k % GROUP
        or data.numel() != rows * k // GROUP * per_group
        or data.dtype != (torch.uint8 if kind in (4, 5, 7) or (kind, bool(panel)) == (6, True) else torch.int8)
        or scale.numel() != rows * k // GROUP * scales
        or scale.dtype not in ((torch.float32, torch.float16) if panel and kind in (4, 7, 8) else (torch.float32,))
        or (offset is not None and offset.dtype != scale.dtype)
        or (offset is None) != (kind not in (4, 5))
    ):
        raise ValueError("inconsistent packed weight")
    return ExactWeight(kind, data, scale, offset, out, k, panel)


def linear_a16(x: torch.Tensor, packed: ExactWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` with ``x`` rounded to 16-bit integers per group of 32 (the ``exact-a16`` format;
    ``packed`` in panels)."""
    if packed.rest is not None:  # a chain: each part into its columns
        outs, start = [], 0
        for p in parts(packed):
            b = None if bias is None else bias[start : start + p.out_features]
            outs.append(linear_a16(x, p, None if b is None else b.contiguous()))
            start += p.out_features
        return torch.cat(outs, dim=1)
    return _gemm(_library().dartspec_qdot, (packed.kind, _half(packed)), x, packed, bias)


def kv_half(keys: torch.Tensor, values: torch.Tensor) -> int:
    """1 where a cache's buffers hold fp16 numbers, 0 where fp32 (what the C attention reads); anything else is
    refused (the kernels would read its bytes as one of these)."""
    if keys.dtype != values.dtype or keys.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"the C attention reads fp32 or fp16 caches, not {keys.dtype} keys and {values.dtype} values")
    return int(keys.dtype == torch.float16)


def attend(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    rot: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    base: int,
    mask: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    scale: float,
) -> torch.Tensor:
    """The lean runtime's attention block for a few new rows in one C call (``attend.c``): per-head norms,
    rotary, the cache write at ``base`` and attention. ``qkv`` (q, (H + 2 KV) D) fp32; ``rot`` (q, D/2, 2)
    cos/sin; ``keys`` / ``values`` the layer's (1, KV, capacity, D) buffers, fp32 or fp16 (:func:`kv_half`); ``mask``
    (q, base + q) bool or None (causal). Returns (q, H D)."""
    q, dim = qkv.shape[0], keys.shape[-1]
    half = kv_half(keys, values)
    out = torch.empty((q, heads * dim), dtype=torch.float32)
    qkv, rot = qkv.contiguous(), rot.contiguous()
    _library().dartspec_attend(
        qkv.data_ptr(),
        q,
        heads,
        kv_heads,
        dim,
        rot.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        keys.shape[2],
        half,
        base,
        mask.data_ptr() if mask is not None else None,
        q_norm.data_ptr() if q_norm is not None else None,
        k_norm.data_ptr() if k_norm is not None else None,
        eps,
        scale,
        out.data_ptr(),
    )
    return out


def attend_many(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    rot: torch.Tensor,
    seqs: SequenceSlots,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    scale: float,
    share: bool = True,
) -> torch.Tensor:
    """:func:`attend` for many sequences in one C call (what :meth:`Block.many` runs between its projections):
    ``qkv`` and ``rot`` hold every sequence's rows one after another, ``seqs`` says whose they are and where each
    cache is (its ``layer`` row). ``share``: sequences on the same prefix pages attend to them together. Returns
    ``(rows, H D)``; the new rows' keys and values are written to the caches."""
    dim = (qkv.shape[1] // (heads + 2 * kv_heads)) if qkv.shape[0] else 0
    out = torch.empty((qkv.shape[0], heads * dim), dtype=torch.float32)
    qkv, rot = qkv.contiguous(), rot.contiguous()
    _library().dartspec_attend_seqs(
        qkv.data_ptr(),
        heads,
        kv_heads,
        dim,
        rot.data_ptr(),
        seqs.count,
        seqs.starts.ctypes.data,
        seqs.kv[seqs.layer].ctypes.data,
        seqs.bases.ctypes.data,
        seqs.masks.ctypes.data,
        _ptr(q_norm),
        _ptr(k_norm),
        eps,
        scale,
        out.data_ptr(),
        int(share),
    )
    return out


class _CLinear(ctypes.Structure):
    """``qdot_linear`` of ``qdot.h``: one linear layer in panels (``rest``: the next part of a chain)."""

    _fields_ = [
        ("kind", ctypes.c_int),
        ("half", ctypes.c_int),
        ("K", ctypes.c_long),
        ("O", ctypes.c_long),
        ("w", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("rest", ctypes.c_void_p),
    ]


class _CBlock(ctypes.Structure):
    """``dartspec_block_weights`` of ``block.c``: one decoder block's weights."""

    _fields_ = [
        ("qkv", _CLinear),
        ("o", _CLinear),
        ("gate_up", _CLinear),
        ("down", _CLinear),
        ("ln1", ctypes.c_void_p),
        ("ln2", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("post_attn", ctypes.c_void_p),
        ("post_ffn", ctypes.c_void_p),
        ("heads", ctypes.c_long),
        ("kv_heads", ctypes.c_long),
        ("head_dim", ctypes.c_long),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("gelu", ctypes.c_int),
        ("sliding", ctypes.c_int),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _c_linear(packed: ExactWeight, bias: torch.Tensor | None, keep: list[object]) -> _CLinear:
    """The C struct of one projection in panels (a chain's later parts in structs it points to); every tensor and
    struct it points to is appended to ``keep``, which its owner holds as long as the struct."""
    if packed.panel == 0:
        raise ValueError("the C kernels need weights in panels (exact.to_panels)")
    b = None if bias is None else bias.detach().contiguous().float()
    first, *later = parts(packed)
    rest = None
    if later:
        tail = chain(later)
        rest = _c_linear(tail, None if b is None else b[first.out_features :], keep)
        keep.append(rest)
    keep += [first.data, first.scale, first.offset, b]
    return _CLinear(
        first.kind,
        _half(first),
        first.in_features,
        first.out_features,
        first.data.data_ptr(),
        first.scale.data_ptr(),
        _ptr(first.offset),
        _ptr(b),
        None if rest is None else ctypes.addressof(rest),
    )


class Head:
    """A model's LM head on weights in panels as one C call (``dartspec_logits``): the logits of some rows (after an
    RMSNorm where ``norm`` is given; as log-probabilities with ``log_softmax``) and each row's argmax, taken in C
    while the logits are in cache (torch operations right after a forward run on cold caches)."""

    def __init__(
        self,
        packed: ExactWeight,
        bias: torch.Tensor | None = None,
        *,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        log_softmax: bool = False,
    ) -> None:
        self._keep: list[object] = []
        self._c = _c_linear(packed, bias, self._keep)
        self._ref = ctypes.byref(self._c)
        self.out_features, self.in_features = packed.out_features, packed.in_features
        self._norm = None if norm is None else norm.detach().contiguous().float()
        self._eps, self._log_softmax = eps, int(log_softmax)
        self._run = _library().dartspec_logits

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits (rows, out), argmax (rows,) int64)`` of ``x`` ``(rows, in)`` (any float dtype, made fp32)."""
        if x.dim() != 2 or x.shape[1] != self.in_features:  # the C code would read past the rows
            raise ValueError(f"the head takes rows of {self.in_features} values, not {tuple(x.shape)}")
        x = x.to(torch.float32).contiguous()
        logits = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
        argmax = torch.empty(x.shape[0], dtype=torch.int64)
        args = (self._ref, x.data_ptr(), x.shape[0], _ptr(self._norm), self._eps, logits.data_ptr())
        self._run(*args, argmax.data_ptr(), self._log_softmax)
        return logits, argmax


class Block:
    """One decoder block of the lean runtime on ``exact-a16`` weights, run by one C call (``block.c``): both
    norms, the four projections, the attention block of :func:`attend`, SiLU and both residual adds."""

    def __init__(
        self,
        linears: tuple[tuple[ExactWeight, torch.Tensor | None], ...],
        ln1: torch.Tensor | None,
        ln2: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        post_attn: torch.Tensor | None = None,
        post_ffn: torch.Tensor | None = None,
        gelu: bool = False,
        sliding: bool = False,
    ) -> None:
        """``linears``: (packed weight in panels, fp32 bias or None) of qkv, o, gate_up and down, in that order;
        ``ln1`` None for a block always called with ``attn_in``. Gemma 3: ``post_attn`` / ``post_ffn`` norm the
        branches' outputs before the residual adds, ``gelu`` for SiLU, ``sliding`` a sliding-window layer (its rotary
        table and masks in :class:`BlockStack`); every norm weight as the factor it multiplies by (Gemma's 1 + w)."""
        # The C struct holds raw pointers: keep every tensor it points to alive (and contiguous fp32).
        norms = [
            t.contiguous().float() if t is not None else None for t in (ln1, ln2, q_norm, k_norm, post_attn, post_ffn)
        ]
        self._keep: list[object] = list(norms)
        linear_structs = [_c_linear(packed, bias, self._keep) for packed, bias in linears]
        c_norms = map(_ptr, norms)
        self._c = _CBlock(*linear_structs, *c_norms, heads, kv_heads, head_dim, eps, scale, int(gelu), int(sliding))
        self._ref = ctypes.byref(self._c)
        self._run = _library().dartspec_block
        self._run_many = _library().dartspec_block_many

    def __call__(
        self,
        x: torch.Tensor,
        rot: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        base: int,
        mask: torch.Tensor | None,
        attn_in: torch.Tensor | None = None,
        pages: SharedPages | None = None,
    ) -> None:
        """Run the block on ``x`` ``(q, hidden)`` fp32 contiguous, **in place**; ``rot``, ``keys``, ``values``,
        ``base`` and ``mask`` as for :func:`attend` (the cache rows ``base .. base + q`` are written).
        ``attn_in`` ``(q, qkv inputs)``: the attention's input instead of ``rms_norm(x, ln1)`` (a drafter layer
        whose attention reads more than its residual stream). ``pages``: the cache's first positions are in
        shared pages (the prefix cache); ``keys``/``values`` then hold the positions after them."""
        self._run(
            self._ref,
            x.data_ptr(),
            None if attn_in is None else attn_in.data_ptr(),
            x.shape[0],
            rot.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            keys.shape[2],
            kv_half(keys, values),
            None if pages is None else pages.keys.ctypes.data,
            None if pages is None else pages.values.ctypes.data,
            0 if pages is None else pages.length,
            0 if pages is None else pages.page,
            base,
            None if mask is None else mask.data_ptr(),
        )

    def many(self, x: torch.Tensor, rot: torch.Tensor, seqs: SequenceSlots, share: bool = True) -> None:
        """The block on the new rows of many sequences, **in place**: ``x`` ``(q, hidden)`` and ``rot`` hold every
        sequence's rows one after another; ``seqs`` says which rows are whose and where their caches are (this
        layer's row of its arrays). The projections run over all rows at once, attention per sequence; ``share``:
        sequences whose caches start with the same shared pages attend to them together (each page read once for
        all of them; the same results bit for bit)."""
        self._run_many(
            self._ref,
            x.data_ptr(),
            None,
            x.shape[0],
            rot.data_ptr(),
            seqs.count,
            seqs.starts.ctypes.data,
            seqs.kv[seqs.layer].ctypes.data,
            seqs.bases.ctypes.data,
            seqs.masks.ctypes.data,
            int(share),
        )


class BlockStack:
    """Every decoder block of a forward in one C call (``dartspec_blocks`` of ``block.c``): :meth:`Block.many` for
    each layer in turn, without returning to Python between layers."""

    def __init__(self, blocks: Sequence[Block], final_norm: torch.Tensor | None = None, eps: float = 0.0) -> None:
        """``final_norm``: the model's final norm weight (its ``eps``), applied to ``x`` at the end of each call."""
        self.blocks = list(blocks)  # keeps their weights and structs alive
        self._ptrs = (ctypes.c_void_p * len(self.blocks))(*(ctypes.addressof(b._c) for b in self.blocks))
        self.final_norm = None if final_norm is None else final_norm.detach().contiguous().float()
        self._eps = eps
        self._run = _library().dartspec_blocks

    def __call__(
        self,
        x: torch.Tensor,
        rot: torch.Tensor,
        seqs: SequenceSlots,
        share: bool = True,
        feature_layers: np.ndarray | None = None,
        feats: torch.Tensor | None = None,
        rot_local: torch.Tensor | None = None,
    ) -> None:
        """All layers on the new rows of ``seqs`` (``kv`` holds every layer's row), ``x`` updated **in place** (to
        the final-norm hidden states where the stack has a ``final_norm``).
        ``feats`` ``(q, len(feature_layers) * hidden)``: the input of layer ``feature_layers[f]`` lands in column
        block f. Sliding-window layers take ``rot_local`` and ``seqs.window_masks`` where given."""
        if (feats is None) != (feature_layers is None):
            raise ValueError("feature_layers and feats go together")
        nfeat = 0 if feature_layers is None else len(feature_layers)
        self._run(
            self._ptrs,
            len(self.blocks),
            x.data_ptr(),
            x.shape[0],
            rot.data_ptr(),
            _ptr(rot_local),
            seqs.count,
            seqs.starts.ctypes.data,
            seqs.kv.ctypes.data,
            seqs.bases.ctypes.data,
            seqs.masks.ctypes.data,
            None if seqs.window_masks is None else seqs.window_masks.ctypes.data,
            int(share),
            nfeat,
            None if feature_layers is None else feature_layers.ctypes.data,
            None if feats is None else feats.data_ptr(),
            _ptr(self.final_norm),
            self._eps,
        )


#: ``dartspec_kv`` of ``qdot.h``, one layer of one sequence's cache: its own key and value buffers and their
#: capacity, then the shared pages before them (page pointer arrays, positions in pages, positions per page), then
#: the own keys' transposed copy (0: none) and how many of its slots are valid, and whether all of these hold fp16
#: numbers (1) or fp32 (0).
KV_SLOT = np.dtype(
    [(name, np.int64) for name in ("k", "v", "cap", "kpages", "vpages", "npre", "page", "kt", "kt_valid", "half")]
)


@dataclass
class SharedPages:
    """The first ``length`` positions of one layer of a sequence's cache, in shared pages of ``page`` positions
    (the prefix cache): ``keys[i]`` / ``values[i]`` point at page i's ``(KV, page, D)`` keys / values (the numbers of
    the caches that share them: fp32 or fp16)."""

    keys: np.ndarray
    values: np.ndarray
    length: int
    page: int


@dataclass
class SequenceSlots:
    """Where :meth:`Block.many` finds each sequence: its rows (``starts``, ``count + 1`` offsets), its cache per
    layer (``kv``, ``(layers, count)`` of :data:`KV_SLOT`), the cached positions before its rows (``bases``) and its
    mask pointer (0: causal); ``layer`` picks the row the next call reads."""

    count: int
    starts: np.ndarray
    kv: np.ndarray
    bases: np.ndarray
    masks: np.ndarray
    layer: int = 0
    #: sliding-window layers' masks (as ``masks``), None where the window hides no key
    window_masks: np.ndarray | None = None


def rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` ``(rows, n)`` fp32 (rows of unit stride, any row stride: e.g. half of wider rows) RMS-normed by ``weight``
    **in place**, by the C code that ends :class:`BlockStack`'s calls (the same numbers bit for bit); returns ``x``."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError("rms_norm_ takes fp32 rows of unit stride and a weight of their width")
    w = weight.contiguous().float()
    _library().dartspec_rms_norm(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), w.data_ptr(), eps)
    return x


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the ``exact-a16`` kernel does to its input, in torch: each group of 32 rounded to 1/32767 of its
    largest magnitude (the reference the kernel is tested against)."""
    rows, k = x.shape
    g = x.float().reshape(rows, k // GROUP, GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, g * (32767 / torch.where(amax > 0, amax, 1)), 0).round().clamp(-32767, 32767)
    return (q * (amax / 32767)).reshape(rows, k)


def attends(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the lean runtime's C attention (and its fp16 KV cache) runs for a model of ``dtype`` on ``device``:
    fp32 on a CPU where the kernels build."""
    return device.type == "cpu" and dtype == torch.float32 and available()


def available() -> bool:
    """Whether the kernel can be built or loaded here (an x86-64 CPU with AVX2 and FMA, and a C compiler). A bad
    DARTSPEC_PREFETCH_HINT is raised, not answered False: a typo must not fall back to slower weights in silence."""
    _prefetch_hint()
    try:
        _library()
    except DartspecError:
        return False
    return True


def kernel(name: str) -> Any:
    """The C function ``name`` of dartspec's kernel library, or None where the library cannot be built here (no
    gcc, not x86-64 with AVX2): its caller then runs its numpy version."""
    return getattr(_library(), name) if available() else None


def _march() -> str:
    # DARTSPEC_MARCH (default native) builds for another instruction set, e.g. x86-64-v3 (AVX2 without AVX-512), so
    # that the AVX2 code paths can be tested on an AVX-512 machine.
    return os.environ.get("DARTSPEC_MARCH", "native")


def _prefetch_hint() -> int:
    """The locality hint of the GEMM's weight prefetch (``qdot.c``'s ``PREFETCH_HINT``, as ``__builtin_prefetch``
    takes it): into L2 (2) on Intel, where the non-temporal prefetch (0) halved a decode step's GEMM throughput;
    non-temporal elsewhere, as measured faster than none on AMD Zen 5. DARTSPEC_PREFETCH_HINT (0-3) overrides it."""
    given = os.environ.get("DARTSPEC_PREFETCH_HINT")
    if given is not None:
        if given not in ("0", "1", "2", "3"):
            raise DartspecError(f"DARTSPEC_PREFETCH_HINT must be 0, 1, 2 or 3, not {given!r}")
        return int(given)
    return 2 if _cpu_field("vendor_id") == "GenuineIntel" else 0


def build_key() -> str:
    """What the compiled kernels depend on (their sources, this CPU's flags, the OpenMP runtime, the target
    instruction set, the prefetch hint), hashed: names the library, and keys measurements that depend on the
    kernels' speed (the tree sizer's verify cost curve)."""
    source = b"".join(src.read_bytes() for src in (*_SOURCES, *_HEADERS))
    extra = str(sorted(_cpu_flags())) + str(_torch_libgomp()) + _march() + f"prefetch{_prefetch_hint()}"
    return hashlib.sha256(source + extra.encode()).hexdigest()[:16]


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    from dartspec.assets import cache_dir

    flags = _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma", "f16c"} <= flags:
        raise DartspecError("--quant exact / exact-a16 need an x86-64 CPU with AVX2 and FMA: use --quant fp16")
    gomp = _torch_libgomp()
    march = _march()
    lib_path = cache_dir() / "kernels" / f"qgemm-{build_key()}.so"
    if not lib_path.is_file():
        compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
        if compiler is None:
            raise DartspecError("--quant exact / exact-a16 compile small C kernels once and need gcc: use --quant fp16")
        with atomic_path(lib_path) as tmp:
            cmd = [
                compiler,
                "-O3",
                f"-march={march}",
                "-fopenmp",
                "-shared",
                "-fPIC",
                "-Werror=implicit-function-declaration",
                f"-DPREFETCH_HINT={_prefetch_hint()}",
            ]
            cmd += list(map(str, _SOURCES))
            cmd += ["-o", str(tmp)]
            if gomp is not None:  # share torch's OpenMP runtime and thread pool instead of starting a second one
                cmd += [f"-Wl,-rpath,{gomp.parent}", str(gomp)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                lines = done.stderr.strip().splitlines() or ["no output"]
                first = next((ln for ln in lines if "error" in ln), lines[0])  # not gcc's "In function ..." line
                raise DartspecError(f"compiling the exact-format kernels failed ({first}): use --quant fp16")
    lib = ctypes.CDLL(str(lib_path))
    fn = lib.dartspec_qgemm
    fn.restype = None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    fn.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    lib.dartspec_qdot.restype = None
    lib.dartspec_qdot.argtypes = [ctypes.c_int, *fn.argtypes]
    lib.dartspec_qdot_panel.restype = ctypes.c_int
    lib.dartspec_qdot_panel.argtypes = []
    lib.dartspec_attend.restype = None
    c_long, ptr = ctypes.c_long, ctypes.c_void_p
    lib.dartspec_attend.argtypes = [ptr, c_long, c_long, c_long, c_long, ptr, ptr, ptr, c_long, c_long, c_long, ptr]
    lib.dartspec_attend.argtypes += [ptr, ptr]
    lib.dartspec_attend.argtypes += [ctypes.c_float, ctypes.c_float, ptr]
    lib.dartspec_block.restype = None
    lib.dartspec_block.argtypes = [ptr, ptr, ptr, c_long, ptr, ptr, ptr, c_long, c_long, ptr, ptr, c_long, c_long]
    lib.dartspec_block.argtypes += [c_long, ptr]
    lib.dartspec_block_many.restype = None
    lib.dartspec_block_many.argtypes = [ptr, ptr, ptr, c_long, ptr, c_long, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.dartspec_blocks.restype = None
    lib.dartspec_blocks.argtypes = [ptr, c_long, ptr, c_long, ptr, ptr, c_long, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.dartspec_blocks.argtypes += [c_long, ptr, ptr, ptr, ctypes.c_float]
    lib.dartspec_rms_norm.restype = None
    lib.dartspec_rms_norm.argtypes = [ptr, c_long, c_long, c_long, ptr, ctypes.c_float]
    lib.dartspec_logits.restype = None
    lib.dartspec_logits.argtypes = [ptr, ptr, c_long, ptr, ctypes.c_float, ptr, ptr, ctypes.c_int]
    lib.dartspec_ngram_prob.restype = None
    lib.dartspec_ngram_prob.argtypes = [ptr, ptr, c_long, ptr, ptr, c_long, ptr, ptr, c_long, ctypes.c_uint64]
    lib.dartspec_ngram_prob.argtypes += [ptr, ptr, c_long, c_long, ptr]
    lib.dartspec_beam_search.restype = c_long
    lib.dartspec_beam_search.argtypes = [ptr, ptr, c_long, c_long, ptr, ptr, ptr, c_long, ptr, ptr, c_long, ptr, ptr]
    lib.dartspec_beam_search.argtypes += [c_long, ctypes.c_uint64, ptr, c_long, c_long, c_long, ctypes.c_double]
    lib.dartspec_beam_search.argtypes += [ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_int, ptr, ptr]
    lib.dartspec_top_candidates.restype = c_long
    lib.dartspec_top_candidates.argtypes = [ptr, c_long, c_long, c_long, c_long, ptr, ptr, ptr]
    lib.dartspec_kv_keep.restype = None
    lib.dartspec_kv_keep.argtypes = [ptr, ptr, ptr, c_long, c_long, c_long, c_long, c_long, ptr, c_long]
    lib.dartspec_lookup.restype = c_long
    lib.dartspec_lookup.argtypes = [ptr, c_long, c_long, c_long, c_long, c_long, ptr, ptr]
    lib.dartspec_attend_seqs.restype = None
    lib.dartspec_attend_seqs.argtypes = [ptr, c_long, c_long, c_long, ptr, c_long, ptr, ptr, ptr, ptr, ptr, ptr]
    lib.dartspec_attend_seqs.argtypes += [ctypes.c_float, ctypes.c_float, ptr, ctypes.c_int]
    return lib


def _cpu_field(name: str) -> str:
    """The first value of ``name`` in /proc/cpuinfo ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((ln for ln in text.splitlines() if ln.split(":")[0].strip() == name), "")
    return line.partition(":")[2].strip()


def _cpu_flags() -> set[str]:
    return set(_cpu_field("flags").split())


def _torch_libgomp() -> Path | None:
    found = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    return found[0] if found else None
