"""A GGUF's K-quant blocks as the exact formats' integer groups, read from the file itself.

A Q4_K_M file mixes block types. Q4_1 / Q5_0 / Q8_0 blocks are found in the dequantized weights alone
(:func:`dartspec.exact.pack`: a group's extremes give its scale), but K-quant blocks are not:

- a Q4_K sub-block of 32 weights is ``d * sc * q - dmin * m`` with 6-bit ``sc`` and ``m`` per sub-block and fp16 ``d``
  and ``dmin`` per 256 weights, and its 4-bit values need not reach 0 or 15, so its scale cannot be read off the
  weights. From the file it is exactly a 4-bit group ``w = D q + M`` with ``D = d * sc`` and ``M = -dmin * m``, both
  exact in fp32 (11 + 6 significant bits); the panels keep the file's own codes (6-bit ``sc`` and ``m`` per group,
  fp16 ``d`` and ``-dmin`` per 256 weights) and the kernel forms the products: 18.5 bytes a group, the same numbers
  as fp32 scales (24 bytes), against 64 as fp16 weights;
- a Q5_K sub-block is the same with a 5-bit ``q``: kind 5 of the integer-dot kernel, uint8 ``q`` with a scale and an
  offset (40 bytes a group; a Q5_K_M file's);
- a Q6_K sub-block of 16 weights is ``d * sc * (q - 32)`` with an int8 ``sc`` per 16 weights: an int8 group of 32
  whose two halves have a scale each (kind 6 of the integer-dot kernel; in the panels its values in 6 bits as in the
  file, with the file's int8 codes and a super-block's fp16 ``d``: 26.25 bytes a group).

Each weight's groups are the numbers gguf's own dequantization (and so the converted model) multiplies, and they
are checked against the loaded weight, bit for bit, before use (in its row order: transformers reorders a Llama
file's query and key rows). Qwen2.5-Coder-0.5B's Q4_K_M file holds twelve Q4_K and twelve Q6_K down projections
(everything else is Q5_0 / Q8_0); in a Q4_K_M file of a model whose widths are multiples of 256 nearly every weight
is Q4_K or Q6_K. The lean runtime fuses projections (q/k/v, gate/up) whose parts are groups: of one kind into one
weight, of different kinds (Q4_K query and key, Q6_K value) into a chain of parts (:func:`dartspec.exact.stack`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from dartspec.exact import GROUP, ExactWeight, map_rows, unpack

#: Weights a K-quant super-block covers (``QK_K`` in ggml).
SUPER_BLOCK = 256


def _scales_and_offsets(head: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """From the first 16 bytes of Q4_K / Q5_K super-blocks (fp16 ``d`` and ``dmin``, then 12 bytes of packed 6-bit
    ``sc`` and ``m``): each sub-block of 32's scale ``d * sc`` and offset ``-dmin * m`` (fp32, exact), ``(n, 8)``, and
    the same in the file's form, the codes ``(n, 8, 2)`` uint8 and ``d``, ``-dmin`` ``(n, 2)`` fp16."""
    from gguf.quants import Q4_K

    d = head[:, :2].copy().view(np.float16)
    neg_dmin = -head[:, 2:4].copy().view(np.float16)
    sc, m = Q4_K.get_scale_min(head[:, 4:16])
    scale, offset = d.astype(np.float32) * sc.astype(np.float32), neg_dmin.astype(np.float32) * m.astype(np.float32)
    return scale, offset, np.stack([sc, m], axis=-1).astype(np.uint8), np.concatenate([d, neg_dmin], axis=1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``(n, 8, 32)`` 4-bit values of super-blocks' 128 bytes: sub-blocks 2i and 2i + 1 are the low and high nibbles
    of bytes 32i .. 32i + 31."""
    shifts = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return ((qs.reshape(qs.shape[0], 4, 1, 32) >> shifts) & 0x0F).reshape(qs.shape[0], 8, 32)


def _super_blocks(blocks: np.ndarray, in_features: int, block_bytes: int, name: str) -> np.ndarray:
    if in_features % SUPER_BLOCK:
        raise ValueError(f"a {name} row holds whole super-blocks of {SUPER_BLOCK} (got {in_features})")
    return np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, block_bytes)


def _groups(
    kind: int,
    q: np.ndarray,
    scale: np.ndarray,
    offset: np.ndarray | None,
    out: int,
    k: int,
    codes: tuple[np.ndarray, np.ndarray] | None = None,
) -> ExactWeight:
    """An :class:`ExactWeight` (rows layout) from per-super-block arrays; ``codes``: the file's own form of its scales
    and offsets (:attr:`ExactWeight.codes`)."""
    groups = k // GROUP

    def rows(a: np.ndarray, n: int, *tail: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.reshape(out, n, *tail)))

    data = rows(q[..., :16] | (q[..., 16:] << 4), groups, 16) if kind == 4 else rows(q, groups, GROUP)
    tail = (2,) if kind == 6 else ()
    coded = None if codes is None else (rows(codes[0], groups, 2), rows(codes[1], groups // 8, -1))
    off = None if offset is None else rows(offset, groups)
    return ExactWeight(kind, data, rows(scale, groups, *tail), off, out, k, codes=coded)


def q4_k_groups(blocks: np.ndarray, out_features: int, in_features: int) -> ExactWeight:
    """The 4-bit groups (rows layout, fp32 scales and offsets) of a Q4_K tensor's raw bytes ``(out, in / 256 *
    144)``: per super-block the scales' 16 bytes, then 128 bytes of nibbles; a weight is ``d * sc * q - dmin * m``."""
    raw = _super_blocks(blocks, in_features, 16 + SUPER_BLOCK // 2, "Q4_K")
    scale, offset, codes, numbers = _scales_and_offsets(raw[:, :16])
    return _groups(4, _nibbles(raw[:, 16:]), scale, offset, out_features, in_features, (codes, numbers))


def q5_k_groups(blocks: np.ndarray, out_features: int, in_features: int) -> ExactWeight:
    """The kind-5 groups (uint8 ``q`` in 0..31, fp32 scales and offsets) of a Q5_K tensor's raw bytes ``(out, in /
    256 * 176)``: per super-block the scales' 16 bytes, 32 bytes of fifth bits (bit j of byte i: sub-block j, weight
    i) and 128 bytes of nibbles as Q4_K's."""
    raw = _super_blocks(blocks, in_features, 16 + SUPER_BLOCK // 8 + SUPER_BLOCK // 2, "Q5_K")
    scale, offset, _, _ = _scales_and_offsets(raw[:, :16])
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    fifth = (raw[:, 16:48].reshape(-1, 1, 32) >> shifts) & 0x01  # (n, 8, 32)
    q = _nibbles(raw[:, 48:]) | (fifth << 4)
    return _groups(5, q, scale, offset, out_features, in_features)


def q6_k_groups(blocks: np.ndarray, out_features: int, in_features: int) -> ExactWeight:
    """The kind-6 groups (rows layout: int8 ``q - 32`` and an fp32 scale per 16 weights) of a Q6_K tensor's raw bytes
    ``(out, in / 256 * 210)``: per super-block 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales and
    an fp16 ``d``; a weight is ``d * scale * (q - 32)`` with a 6-bit ``q``."""
    half = SUPER_BLOCK // 2
    raw = _super_blocks(blocks, in_features, half + half // 2 + SUPER_BLOCK // 16 + 2, "Q6_K")
    n = raw.shape[0]
    # 64 bytes of low nibbles serve 128 weights (low then high nibble), 32 bytes of high parts serve 128 (4 shifts).
    low = (raw[:, :half].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (raw[:, half : half + half // 2].reshape(n, 2, 1, 32) >> shifts) & 0x03
    q = (low.reshape(n, SUPER_BLOCK) | (high.reshape(n, SUPER_BLOCK) << 4)).astype(np.int8) - np.int8(32)
    codes = raw[:, half + half // 2 : -2].copy().view(np.int8)  # (n, 16)
    d = raw[:, -2:].copy().view(np.float16)  # (n, 1)
    scale = d.astype(np.float32) * codes.astype(np.float32)
    return _groups(6, q, scale, None, out_features, in_features, (codes, d))


#: The GGUF tensor kinds whose integer groups the lean runtime takes from the file.
GROUP_KINDS = frozenset({"Q4_K", "Q5_K", "Q6_K"})


def holds_no_groups(folder: str | Path | None) -> bool:
    """Whether the conversion manifest of ``folder`` records that its GGUF holds no tensor of :data:`GROUP_KINDS`
    (False where it records nothing: conversions before the record, other folders)."""
    kinds = (_source_record(folder) or {}).get("tensor_types")
    return isinstance(kinds, list) and not GROUP_KINDS & set(kinds)


def _source_record(folder: str | Path | None) -> dict | None:
    """The conversion manifest's record of the GGUF a folder was made from, or None (no folder, no manifest)."""
    from dartspec.model_cache import MANIFEST_NAME

    if not folder:
        return None
    try:
        source = json.loads((Path(folder) / MANIFEST_NAME).read_text(encoding="utf-8"))["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return source if isinstance(source, dict) else None


def source_gguf(folder: str | Path | None) -> Path | None:
    """The GGUF file a converted model folder was made from, where it is still on this machine (its manifest names
    it; the file sits in the folder's sibling ``gguf/<name>/`` for known models, or at the recorded path), else None."""
    from dartspec.models import assembled_gguf_path

    if not folder or (source := _source_record(folder)) is None:
        return None
    folder = Path(folder)
    candidates = [Path(p) for p in (source.get("path"),) if p]
    # A known model converted before manifests recorded the path: its folder is <cache>/models/<name>
    candidates.append(assembled_gguf_path(folder.parent.parent, folder.name, str(source.get("file", ""))))
    for path in candidates:
        if path.is_file() and path.stat().st_size == source.get("size"):
            return path
    return None


def file_groups(gguf_path: Path, weights: Mapping[str, torch.Tensor]) -> dict[str, ExactWeight]:
    """The integer groups of those ``weights`` (Hugging Face parameter names -> loaded fp32 tensors) that are Q4_K,
    Q5_K or Q6_K tensors of ``gguf_path`` and that the groups reproduce bit for bit (in the weight's row order); the
    other weights are left out."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    arch_name = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        return {}
    blocks = int(reader.fields[f"{arch_name}.block_count"].parts[-1][0])
    names = gguf.get_tensor_name_map(arch, blocks)
    kinds = gguf.GGMLQuantizationType
    readers = {kinds.Q4_K: q4_k_groups, kinds.Q5_K: q5_k_groups, kinds.Q6_K: q6_k_groups}
    tensors = {t.name: t for t in reader.tensors if t.tensor_type in readers}
    found: dict[str, ExactWeight] = {}
    for name, weight in weights.items():
        tensor = tensors.get(names.get_name(name, try_suffixes=(".weight", ".bias")) or "")
        if tensor is None or weight.dim() != 2 or weight.shape[1] % SUPER_BLOCK:
            continue
        out, k = weight.shape
        if tuple(int(n) for n in tensor.shape) != (k, out):  # a GGUF lists a tensor's dimensions innermost first
            continue
        groups = readers[tensor.tensor_type](np.asarray(tensor.data), out, k)
        rows, expected = unpack(groups), weight.detach().to(device="cpu", dtype=torch.float32)
        if not torch.equal(rows, expected):
            order = _row_order(rows, expected)
            if order is None:
                continue
            groups = map_rows(groups, lambda t, order=order: t[order])
        found[name] = groups
    return found


def _row_order(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The order of ``rows`` that makes them ``weight`` (transformers reorders a Llama GGUF's query and key rows, whose
    file layout is rotary's other convention), or None where none does."""
    if rows.shape != weight.shape:
        return None
    where = {row.tobytes(): i for i, row in enumerate(rows.numpy())}
    order = [where.get(row.tobytes()) for row in weight.numpy()]
    return None if None in order else torch.tensor(order)
