"""Weight formats for the lean runtime's linear layers: ``y = x W^T + b`` with W stored compactly.

On a CPU, decoding one token streams every weight from memory once, so the bytes per weight set the
speed of plain decoding and of small-tree verification. The formats:

- ``none``: float weights as loaded (fp32 on CPU); small row counts use the rows-first GEMM order of
  :mod:`dartspec.kernels`.
- ``fp16``: weights stored in half precision, arithmetic in fp32. Half the bytes; the only change to the model
  is rounding each weight to fp16 (11 significant bits), which keeps greedy answers identical to fp32 in our
  fidelity gate. Where dartspec's C kernels build (:mod:`dartspec.exact`, x86-64 with AVX2) the weights are
  panels they widen in registers (every row computed on its own, so a draft tree's rows equal one-token decoding
  bit for bit, and the fused decoder blocks take them); elsewhere fbgemm's packed fp16 GEMM, which rounds by row
  count.
- ``int8``: int8 weights with one scale per output channel, activations quantized to 8 bits per *row*.
  fbgemm's dynamic int8 GEMM quantizes the whole input with one range; each row is divided by its own
  largest magnitude and two constant columns +1 and -1 (with zero weights) are appended, so that range is
  always exactly [-1, 1]: every row is quantized the same way whatever else is in the batch, and a tree
  verification computes what one-token decoding computes. A quarter of the bytes and the flattest cost
  curve, but it changes the model's answers: it fails the fidelity gate (README), so it is never a default.
- ``exact``: the integer weight groups a GGUF-converted model is made of, kept bit for bit, widened to
  fp32 in registers by dartspec's own small C kernel (:mod:`dartspec.exact`); fp32 arithmetic. Only for
  models whose every weight is such a group (a clear error otherwise).
- ``exact-a16``: the same integer weights, activations rounded to 16-bit integers per group of 32, integer
  dot products (:mod:`dartspec.exact`). The fastest format at every row count, within the fidelity gate. With
  ``fallback="fp16"`` (``--quant auto``) a weight that is no such groups (a model not from a GGUF file, block
  types other than Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q5_K / Q6_K) is kept as fp16 panels that the same C kernels
  and fused blocks run (fp32 arithmetic, every row on its own).

Why these kernels: measured on the 2-core CPUs this project runs on (README "CPU runtime"), fbgemm's fp16
and int8 GEMMs stream weights at 20-30 GB/s for 1-8 rows, while the alternatives in torch 2.13
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``, ``torch._int_mm`` that torchao's CPU int8
configs lower to) were 2-20x slower than fp32 on the same shapes.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dartspec.errors import DartspecError
from dartspec.formats import QUANT_FORMATS
from dartspec.kernels import RowsFirstLinear, rows_first_linear, use_rows_first_linears

if TYPE_CHECKING:
    from dartspec.exact import ExactWeight

#: Formats made of a GGUF model's own integer weight groups (packed by :mod:`dartspec.exact`).
EXACT_FORMATS = ("exact", "exact-a16")

_PIN = torch.tensor([[1.0, -1.0]])
# The overloads themselves: calling the op packets costs ~14 us a call in Python checks for fake script
# objects (121 calls per SmolLM2 forward), the overloads go straight to the kernel.
_FP16_LINEAR = torch.ops.quantized.linear_dynamic_fp16.default
_INT8_LINEAR = torch.ops.quantized.linear_dynamic.default


def check_format(fmt: str, device: torch.device) -> None:
    """A one-line error for an unknown format or one this device cannot run."""
    if fmt not in QUANT_FORMATS:
        raise DartspecError(f"unknown --quant {fmt!r}: choose one of {', '.join(QUANT_FORMATS)}")
    if fmt != "none" and device.type != "cpu":
        raise DartspecError(
            f"--quant {fmt} is a CPU format (fbgemm kernels); on {device.type} use --quant none with --dtype bfloat16"
        )


def not_integer_groups(fmt: str) -> DartspecError:
    """The error for an exact format asked to hold a weight that is no integer groups of the kinds it keeps."""
    return DartspecError(
        f"--quant {fmt}: this model's weights are not integer groups of the kinds dartspec keeps (it does not come "
        "from a GGUF file still on this machine, or its blocks are of types such as Q2_K / Q3_K): use --quant auto "
        "(exact where it can, fp16 elsewhere) or --quant fp16"
    )


def _packed_form(
    weight: torch.Tensor, fmt: str, packed: ExactWeight | None, fallback: str | None
) -> tuple[str, ExactWeight | None]:
    """The format ``weight`` runs in and its form for dartspec's C kernels (None: torch's kernels run it).

    Exact formats: ``packed`` (from the cache) or the weight's integer groups; where it has none, fp16 panels when
    ``fallback`` is ``"fp16"`` (that weight then runs in the fp16 format), else an error. ``fp16`` on a CPU where the
    kernels build: fp16 panels (every row computed on its own; the fused blocks take them), else fbgemm."""
    from dartspec import exact

    if fmt in EXACT_FORMATS:
        if packed is None and (packed := exact.pack(weight)) is not None and fmt == "exact-a16":
            packed = exact.to_panels(packed)
        if packed is not None and packed.kind != 16:
            return fmt, packed
        if fallback is None:  # no integer groups (or fp16 panels in the cache of a model that has such weights)
            raise not_integer_groups(fmt)
        return fallback, packed if packed is not None else exact.half_panels(weight)
    if fmt == "fp16" and weight.device.type == "cpu" and exact.available():
        return fmt, exact.half_panels(weight)
    return fmt, None


class PackedLinear:
    """One linear layer in a weight format; call it like ``F.linear`` on ``(rows, in)`` inputs.

    The format's kernel is bound once here, so a call in the decode loop is one attribute lookup, not a chain
    of format tests.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        fmt: str,
        *,
        packed: ExactWeight | None = None,
        fallback: str | None = None,
    ) -> None:
        """``packed``: the exact formats' packed form of ``weight`` when already known (the on-disk cache);
        ``fallback``: ``"fp16"`` to keep ``weight`` as fp16 panels where an exact format cannot hold it (else that
        is an error)."""
        check_format(fmt, weight.device)
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.fmt, self.packed = _packed_form(weight, fmt, packed, fallback)
        if self.fmt == "none":
            self.weight = weight
            self.nbytes = weight.nbytes
            self.forward = self._dense
            return
        if self.packed is not None:
            from dartspec import exact

            kernel = exact.linear if self.packed.panel == 0 else exact.linear_a16
            self.forward = functools.partial(kernel, packed=self.packed, bias=bias)
            self.nbytes = self.packed.nbytes
            return
        w = weight.detach().float()
        with warnings.catch_warnings():
            # torch 2.13 marks the quantized-tensor constructors deprecated; we pin 2.13.
            warnings.simplefilter("ignore")
            if self.fmt == "fp16":
                self._packed = torch.ops.quantized.linear_prepack_fp16(w.half().float(), bias)
                self.forward = self._fp16
            else:
                w = F.pad(w, (0, 2))  # zero weights for the two range-pinning columns
                scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
                qw = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
                self._packed = torch.ops.quantized.linear_prepack(qw, None)
                self.forward = self._int8
        self.nbytes = self.out_features * self.in_features * (2 if self.fmt == "fp16" else 1)  # weight bytes a call

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        # rows_first_linear hands back a transposed view; the rotary pairs need unit stride.
        return rows_first_linear(x, self.weight, self.bias).contiguous()

    def _fp16(self, x: torch.Tensor) -> torch.Tensor:
        return _FP16_LINEAR(x.contiguous(), self._packed)

    def _int8(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-12)
        pinned = torch.cat([x / scale, _PIN.to(x.dtype).expand(x.shape[0], 2)], dim=-1)
        y = _INT8_LINEAR(pinned, self._packed, True) * scale
        return y if self.bias is None else y + self.bias


def fuse(*weights: torch.Tensor | None) -> torch.Tensor | None:
    """Rows of several projections stacked into one matrix (or None when all are None)."""
    present = [w for w in weights if w is not None]
    if not present:
        return None
    if len(present) != len(weights):
        raise DartspecError("cannot fuse projections where only some have a bias")
    return torch.cat(present, dim=0)


class FormatLinear(nn.Linear):
    """An ``nn.Linear`` whose forward runs a :class:`PackedLinear` made from its own parameters (inference)."""

    kernel: PackedLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)


def use_fast_linears(module: nn.Module, target: object) -> None:
    """Give a drafter network the fastest linear kernels for ``target``'s machine, in place.

    On a CPU in float32 the linears become the ``fp16`` format's GEMMs: the shipped drafters are stored in fp16, so
    this changes no weight, only halves the bytes each drafting step streams (drafting was ~15% of a DART step on
    the lean runtime). Elsewhere the rows-first dispatch of :mod:`dartspec.kernels` applies where the target
    uses it. Proposals never affect losslessness: verification decides.
    """
    weight = next(module.parameters())
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        for sub in module.modules():
            if type(sub) in (nn.Linear, RowsFirstLinear):
                sub.__class__ = FormatLinear
                sub.kernel = PackedLinear(sub.weight.detach(), sub.bias, "fp16")
    elif getattr(target, "fast_linear", False):
        use_rows_first_linears(module)
