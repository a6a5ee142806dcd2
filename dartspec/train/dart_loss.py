"""DART's training objective: many anchor blocks per sequence, many sequences, one drafter forward.

The sequence's real positions i = 0..T-2 carry (fc(h_i), emb(x_{i+1})), causal among themselves;
their own output rows predict depth 1 (token x_{i+2}). Each sampled anchor a gets its own block of
d-1 mask slots at positions a+1..a+d-1 that see the real positions <= a and the earlier slots of the
same block only, so one forward trains every anchor exactly as drafting at step a would see it.
Slot j of anchor a predicts depth j+1, i.e. token x_{a+j+2}, whose target distribution is the
target's logits at position a+j+1. Loss: KL(target || draft) over the draft vocabulary (the target's
distribution restricted to it and renormalised), depth t weighted ``decay ** (t-1)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dartspec.drafters.dart_model import DartModel
from dartspec.runtime import host_values, to_device


@dataclass(frozen=True)
class AnchorLayout:
    """Where every drafter row sits: positions, attention mask, and the target row it is scored on."""

    positions: torch.Tensor  # (N,) RoPE positions
    mask: torch.Tensor  # (N, N) bool, True = may attend
    depth: torch.Tensor  # (N,) depth predicted by each row (1..d); 0 = row not scored
    target_row: torch.Tensor  # (N,) index into the target's logits (valid where depth > 0)
    n_real: int


def anchor_layout(
    seq_len: int, prompt_len: int, depth: int, anchors: torch.Tensor, device: torch.device | str = "cpu"
) -> AnchorLayout:
    """Layout for a sequence of ``seq_len`` tokens with anchor blocks at ``anchors`` (real positions).

    Only predictions of answer tokens (index >= prompt_len) are scored.
    """
    n_real = seq_len - 1
    k = anchors.numel()
    n_slots = depth - 1
    n = n_real + k * n_slots
    anchors = anchors.to(device)
    real_pos = torch.arange(n_real, device=device)
    slot_j = torch.arange(1, n_slots + 1, device=device)
    slot_pos = (anchors[:, None] + slot_j[None, :]).reshape(-1)
    positions = torch.cat([real_pos, slot_pos])

    mask = torch.zeros(n, n, dtype=torch.bool, device=device)
    mask[:n_real, :n_real] = torch.ones(n_real, n_real, dtype=torch.bool, device=device).tril_()
    if k:
        # Slot rows: see real positions <= anchor ...
        slot_anchor = anchors.repeat_interleave(n_slots)
        mask[n_real:, :n_real] = real_pos[None, :] <= slot_anchor[:, None]
        # ... and earlier slots of their own block (block-diagonal lower triangles).
        slot = torch.arange(k * n_slots, device=device)
        same_block = (slot[:, None] // n_slots) == (slot[None, :] // n_slots)
        mask[n_real:, n_real:] = same_block & ((slot[None, :] % n_slots) <= (slot[:, None] % n_slots))

    depth_of = torch.cat([torch.ones(n_real, dtype=torch.long, device=device), (slot_j + 1).repeat(k)])
    target_row = positions + 1  # row r predicts token positions[r] + 2, scored on target logits at positions[r] + 1
    scored = (target_row <= seq_len - 1) & (target_row + 1 >= prompt_len)
    depth_of = torch.where(scored, depth_of, torch.zeros_like(depth_of))
    target_row = target_row.clamp(max=seq_len - 1)
    return AnchorLayout(positions, mask, depth_of, target_row, n_real)


@dataclass(frozen=True)
class PaddedLayout:
    """The layouts of a batch of sequences, row b of each tensor holding sequence b's rows padded to ``N``:
    padding rows sit at position 0, attend only to themselves and are never scored (depth 0, target row 0)."""

    positions: torch.Tensor  # (B, N)
    mask: torch.Tensor  # (B, N, N) bool
    depth: torch.Tensor  # (B, N)
    target_row: torch.Tensor  # (B, N)
    n_real: torch.Tensor  # (B,) real rows of each sequence (its first rows)
    scored: int  # rows with depth > 0, counted on the host (so finding them needs no read of the device)

    def scored_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sequence, row)`` of every scored row, in row-major order, as ``nonzero`` gives them but without
        its read of the device (which would hold the host until the drafter's forward has run): each scored row's
        place among them is a cumulative sum, and a scatter puts it there (unscored rows into one spare slot)."""
        flat = (self.depth > 0).flatten()
        place = torch.where(flat, flat.cumsum(0) - 1, self.scored)
        index = torch.empty(self.scored + 1, dtype=torch.long, device=flat.device)
        index.scatter_(0, place, torch.arange(flat.numel(), device=flat.device))
        width = self.depth.shape[1]
        return index[: self.scored] // width, index[: self.scored] % width


def scored_count(length: int, prompt: int, anchors: Sequence[int], slots: int) -> int:
    """Rows of one sequence's layout that are scored (see :func:`anchor_layout`), from its sizes alone: real row r
    (target position r + 1) when r + 2 >= prompt; slot j of anchor a (target a + j + 1) when a + j + 1 <= length - 1
    and a + j + 2 >= prompt."""
    real = max(0, (length - 1) - max(0, prompt - 2))
    return real + sum(max(0, min(slots, length - 2 - a) - max(1, prompt - 2 - a) + 1) for a in anchors)


def anchor_layouts(
    lengths: Sequence[int],
    prompt_lens: Sequence[int],
    anchors: Sequence[torch.Tensor],
    depth: int,
    device: torch.device | str,
) -> PaddedLayout:
    """Each sequence's :func:`anchor_layout` (the readable definition, which tests hold this to), padded into one
    batch and built for the whole batch in one pass of tensor operations (one asynchronous host-to-device copy, not a
    loop of ~20 small operations and a copy per sequence)."""
    batch, slots = len(lengths), depth - 1
    counts = [a.numel() for a in anchors]
    table = torch.zeros(batch, max(1, *counts), dtype=torch.long)
    for b, a in enumerate(anchors):
        table[b, : a.numel()] = a
    sizes = torch.tensor(
        [[length, prompt, count] for length, prompt, count in zip(lengths, prompt_lens, counts, strict=True)]
    )
    n_scored = sum(
        scored_count(length, prompt, host_values(a), slots)
        for length, prompt, a in zip(lengths, prompt_lens, anchors, strict=True)
    )
    both = to_device(torch.cat([sizes, table], dim=1), device)
    sizes, table = both[:, :3], both[:, 3:]
    length, prompt, count = sizes.unbind(1)
    n_real = length - 1
    n = max(length_ - 1 + count_ * slots for length_, count_ in zip(lengths, counts, strict=True))
    row = torch.arange(n, device=device)[None, :]
    real = row < n_real[:, None]
    offset = row - n_real[:, None]  # a slot row's place among its sequence's slot rows
    slot = (offset >= 0) & (offset < (count * slots)[:, None])
    block = (offset // max(slots, 1)).clamp(0, table.shape[1] - 1)  # its anchor block
    j = offset % max(slots, 1) + 1  # its slot in the block, 1..d-1
    anchor = table.gather(1, block)
    positions = torch.where(real, row, torch.where(slot, anchor + j, 0))
    target = positions + 1
    scored = (real | slot) & (target <= (length - 1)[:, None]) & (target + 1 >= prompt[:, None])
    depth_of = torch.where(scored, torch.where(real, 1, j + 1), 0)
    target_row = torch.where(real | slot, torch.minimum(target, (length - 1)[:, None]), 0)
    # Real keys up to a row's own position (real rows) or its anchor (slot rows); the earlier slots of a slot row's
    # own block; padding rows only themselves.
    sees = torch.where(real, row, torch.where(slot, anchor, -1))
    mask = real[:, None, :] & (row[:, None, :] <= sees[:, :, None])
    same_block = (block[:, :, None] == block[:, None, :]) & (j[:, None, :] <= j[:, :, None])
    mask |= slot[:, :, None] & slot[:, None, :] & same_block
    mask |= torch.eye(n, dtype=torch.bool, device=device) & ~(real | slot)[:, :, None]
    return PaddedLayout(positions, mask, depth_of, target_row, n_real, n_scored)


def sample_anchors(seq_len: int, prompt_len: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to ``count`` distinct anchors whose depth-2 prediction lies in the answer, sorted."""
    lo = max(prompt_len - 2, 0)
    hi = seq_len - 3  # anchor a needs token a+3 for depth 2
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    span = hi - lo + 1
    if span <= count:
        return torch.arange(lo, hi + 1)
    return (torch.randperm(span, generator=generator)[:count] + lo).sort().values


@dataclass
class LossOutput:
    """An objective's value and its per-depth figures. The figures stay where they were computed until asked for:
    on a GPU each read waits for the device, and a training step, which logs none of them, must not stop the host
    mid-step (evaluation reads them)."""

    loss: torch.Tensor  # mean over the sequences scored
    depth_stats: torch.Tensor  # (3, d): per depth the mean loss over the sequences, top-1 hits, rows scored

    @property
    def per_depth_loss(self) -> list[float]:
        return self.depth_stats[0].tolist()

    @property
    def per_depth_correct(self) -> list[int]:
        """Draft top-1 == target top-1, summed over the sequences."""
        return [round(x) for x in self.depth_stats[1].tolist()]

    @property
    def per_depth_count(self) -> list[int]:
        return [round(x) for x in self.depth_stats[2].tolist()]


def distill(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, d2t: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss of draft logits (draft vocabulary) against the target's (full vocabulary), and top-1 hits.

    ``kind``: ``"kl"`` (KL to the target's distribution restricted to the draft vocabulary ``d2t`` and
    renormalised) or ``"ce"`` (cross-entropy to the target's best draft-vocabulary token). A hit means the
    draft's top-1, mapped to a target id, is the target's top-1 over its *whole* vocabulary: what greedy
    verification accepts (a target choice outside the draft vocabulary is always a miss).
    """
    with torch.no_grad():
        target_draft, target_top = target_logits[:, d2t], target_logits.argmax(-1)
    return distill_rows(draft_logits, target_draft, target_top, d2t, kind)


def distill_rows(
    draft_logits: torch.Tensor, target_draft: torch.Tensor, target_top: torch.Tensor, d2t: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`distill` from the target's logits over the draft vocabulary (``target_draft``, columns ``d2t``) and
    its top-1 over the whole vocabulary (``target_top``): a caller scoring many rows on one target position takes
    these once per position, not a full-vocabulary row per scored row."""
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    with torch.no_grad():
        t_logits = target_draft.float()
        p = torch.softmax(t_logits, dim=-1)
    if kind == "kl":
        per_row = (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1)
    elif kind == "ce":
        per_row = F.nll_loss(logq, t_logits.argmax(-1), reduction="none")
    else:
        raise ValueError(f"unknown loss kind {kind!r} (kl or ce)")
    return per_row, d2t[logq.argmax(-1)] == target_top


def dart_loss(
    model: DartModel,
    features: torch.Tensor,
    next_embeds: torch.Tensor,
    target_logits: torch.Tensor,
    layout: PaddedLayout,
    *,
    decay: float = 0.6,
    kind: str = "kl",
) -> LossOutput:
    """Weighted per-depth loss of the drafter on a batch of sequences, all in one drafter forward.

    Sequence b's rows (its layout) fill row b of a padded ``(B, N)`` block; padding rows attend only to
    themselves and are never scored, and no row attends across sequences, so each sequence's loss is what
    it would be alone. The loss is the mean over sequences of each one's weighted per-depth mean; the
    per-depth figures are summed (hits, counts) or averaged (losses) over the batch.

    Args:
        features: ``(B, T, F*H)`` target features, sequence b valid for its first ``n_real[b] + 1`` rows.
        next_embeds: ``(B, T-1, H)`` target embeddings of tokens 1..T-1.
        target_logits: ``(B, T, V)`` target logits (row i predicts token i+1).
        layout: :func:`anchor_layouts` of the batch.
        kind: ``"kl"`` (to the target's distribution) or ``"ce"`` (to the target's argmax token).
    """
    batch, width = features.shape[0], features.shape[1] - 1
    n = layout.positions.shape[1]
    # Sequence b's first n_real[b] drafter rows are its real positions, in order; every other row (anchor slots,
    # padding) takes the mask slot's input. Chosen elementwise, not gathered by a row index: the gather's backward
    # accumulates the thousands of rows that share the mask slot's index one after another on a GPU (~45 ms of the
    # H200 window's profiled training step went to it).
    real = (torch.arange(n, device=features.device)[None, :] < layout.n_real[:, None])[..., None]
    x_r, h_r = model.real_inputs(features[:, :width], next_embeds[:, :width])
    x_m, h_m = model.mask_inputs(1)

    def rows_of(real_rows: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        real_rows = real_rows[:, :n]
        return torch.where(real, F.pad(real_rows, (0, 0, 0, n - real_rows.shape[1])), slot.to(real_rows.dtype))

    hidden = model(rows_of(x_r, x_m), rows_of(h_r, h_m), layout.positions, layout.mask)
    seq, row = layout.scored_rows()
    # A target position is scored by up to d rows (its real row and anchors' slots): restrict the target's logits to
    # the draft vocabulary and take its top-1 once per position, then gather rows (the full-vocabulary rows gathered
    # per scored row were ~13 GB of fp32 on the window's steps).
    with torch.no_grad():
        target_draft, target_top = target_logits[..., model.d2t], target_logits.argmax(-1)
    at = layout.target_row[seq, row]
    # index_select, whose backward adds rows into place, not advanced indexing, whose backward sorts the indices.
    scored = hidden.flatten(0, 1).index_select(0, seq * n + row)
    per_row, correct = distill_rows(model.lm_head(scored), target_draft[seq, at], target_top[seq, at], model.d2t, kind)

    return depth_summary(per_row, correct, seq, layout.depth[seq, row], batch, model.cfg.depth, decay)


def depth_summary(
    per_row: torch.Tensor,
    correct: torch.Tensor,
    seq: torch.Tensor,
    depth: torch.Tensor,
    batch: int,
    d: int,
    decay: float,
) -> LossOutput:
    """The objective from scored rows (row loss, top-1 hit, its sequence and depth 1..d): per sequence the
    ``decay ** (t-1)``-weighted sum of its per-depth mean losses, averaged over the ``batch`` sequences."""
    # Per-(sequence, depth) sums with index_add (no host round trip per depth: on a GPU those syncs dominated).
    device = per_row.device
    key = seq * d + depth - 1
    count = per_row.new_zeros(batch * d).index_add_(0, key, torch.ones_like(per_row)).view(batch, d)
    loss_sum = per_row.new_zeros(batch * d).index_add_(0, key, per_row).view(batch, d)
    hits = per_row.new_zeros(batch * d).index_add_(0, key, correct.to(per_row.dtype)).view(batch, d)
    mean = loss_sum / count.clamp_min(1)
    weights = decay ** torch.arange(d, dtype=per_row.dtype, device=device)
    total = (mean * weights).sum(-1).mean()
    return LossOutput(total, torch.stack([mean.detach().mean(0), hits.sum(0), count.sum(0)]))


def dart_anchor_loss(
    model: DartModel,
    features: torch.Tensor,
    next_embeds: torch.Tensor,
    target_logits: torch.Tensor,
    lengths: Sequence[int],
    prompt_lens: Sequence[int],
    *,
    anchors: int,
    generator: torch.Generator,
    decay: float = 0.6,
    kind: str = "kl",
) -> LossOutput:
    """:func:`dart_loss` over up to ``anchors`` anchor blocks per sequence drawn with ``generator`` (the
    training objective); sequence b holds ``lengths[b]`` tokens of which ``prompt_lens[b]`` are prompt."""
    picked = [sample_anchors(n, p, anchors, generator) for n, p in zip(lengths, prompt_lens, strict=True)]
    layout = anchor_layouts(lengths, prompt_lens, picked, model.cfg.depth, target_logits.device)
    return dart_loss(model, features, next_embeds, target_logits, layout, decay=decay, kind=kind)
