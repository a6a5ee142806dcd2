"""DFlash's training objective: random anchor blocks of many sequences in one drafter forward.

For a sequence x_0..x_{T-1} with target features h_0..h_{T-1}, an anchor a (1 <= a <= T-2) is a block
[x_a, MASK x d] at positions a..a+d that sees the context rows of positions < a (the features a drafting step has
when x_a is the root just committed) and its whole block, nothing else: one forward trains every anchor as drafting
at that point would see it. Block row k (1..d) predicts x_{a+k}, scored against the target's logits at position
a+k-1 (answer tokens only), weighted ``decay ** (k-1)`` (the reference: exp(-(k-1)/7)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dartspec.drafters.dflash_model import DFlashModel
from dartspec.train.dart_loss import LossOutput, depth_summary, distill

#: The reference's per-position weight exp(-(k-1)/7) as a decay per depth.
REFERENCE_DECAY = math.exp(-1 / 7)


def sample_block_anchors(seq_len: int, prompt_len: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to ``count`` distinct anchors whose depth-1 prediction is an answer token, sorted."""
    lo = max(prompt_len - 1, 1)
    hi = seq_len - 2
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    span = hi - lo + 1
    if span <= count:
        return torch.arange(lo, hi + 1)
    return (torch.randperm(span, generator=generator)[:count] + lo).sort().values


def dflash_loss(
    model: DFlashModel,
    features: torch.Tensor,
    next_embeds: torch.Tensor,
    target_logits: torch.Tensor,
    lengths: Sequence[int],
    prompt_lens: Sequence[int],
    anchors: Sequence[torch.Tensor],
    *,
    decay: float = REFERENCE_DECAY,
    kind: str = "ce",
) -> LossOutput:
    """The weighted per-depth loss over the ``anchors`` of each sequence (padded into one batched forward; no row
    attends across sequences or to another anchor's block).

    Args:
        features: ``(B, T, K H)`` target features (sequence b valid for its first ``lengths[b]`` rows).
        next_embeds: ``(B, T-1, H)`` target embeddings of tokens 1..T-1 (anchor a's token is row a-1).
        target_logits: ``(B, T, V)`` (row i predicts token i+1).
    """
    batch, T = features.shape[:2]
    device = features.device
    d = model.cfg.depth
    k = max(1, max(a.numel() for a in anchors))
    anchor = torch.ones(batch, k, dtype=torch.long, device=device)  # padding anchors: position 1, never scored
    valid = torch.zeros(batch, k, dtype=torch.bool, device=device)
    for b, a in enumerate(anchors):
        anchor[b, : a.numel()] = a.to(device)
        valid[b, : a.numel()] = True
    ctx = model.context(features)  # (B, T, H)
    ctx_positions = torch.arange(T, device=device).expand(batch, T)
    contexts = [layer.kv(ctx, ctx_positions) for layer in model.layers]  # (B, kv, T, hd) each

    slot = torch.arange(d + 1, device=device)
    positions = (anchor[:, :, None] + slot).flatten(1)  # (B, k (d + 1))
    anchor_embeds = next_embeds.gather(1, (anchor - 1)[:, :, None].expand(-1, -1, next_embeds.shape[-1]))
    h = model.block_inputs(anchor_embeds).flatten(1, 2)  # (B, k (d + 1), H)
    # Each block row sees the context before its anchor and its own block (whole: non-causal).
    rows_anchor = anchor.repeat_interleave(d + 1, dim=1)  # (B, N)
    sees_context = torch.arange(T, device=device)[None, None, :] < rows_anchor[:, :, None]
    block_of = torch.arange(k, device=device).repeat_interleave(d + 1)
    same_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
    mask = torch.cat([sees_context, same_block], -1)
    hidden = model.block(h, positions, contexts, mask)

    # Block row (anchor a, slot s >= 1) predicts x_{a+s}: target row a+s-1; scored if an answer token of the sequence.
    length = torch.tensor(list(lengths), device=device)[:, None, None]
    prompt = torch.tensor(list(prompt_lens), device=device)[:, None, None]
    token = anchor[:, :, None] + slot[None, None, 1:]  # (B, k, d)
    scored = valid[:, :, None] & (token <= length - 1) & (token >= prompt)
    seq, a_idx, s_idx = scored.nonzero(as_tuple=True)
    rows = a_idx * (d + 1) + s_idx + 1
    per_row, correct = distill(
        model.lm_head(hidden[seq, rows]), target_logits[seq, token[seq, a_idx, s_idx] - 1], model.d2t, kind
    )
    return depth_summary(per_row, correct, seq, s_idx + 1, batch, d, decay)


def dflash_anchor_loss(
    model: DFlashModel,
    features: torch.Tensor,
    next_embeds: torch.Tensor,
    target_logits: torch.Tensor,
    lengths: Sequence[int],
    prompt_lens: Sequence[int],
    *,
    anchors: int,
    generator: torch.Generator,
    decay: float = REFERENCE_DECAY,
    kind: str = "ce",
) -> LossOutput:
    """:func:`dflash_loss` over up to ``anchors`` random anchor blocks per sequence (the training objective)."""
    picked = [sample_block_anchors(n, p, anchors, generator) for n, p in zip(lengths, prompt_lens, strict=True)]
    return dflash_loss(
        model, features, next_embeds, target_logits, lengths, prompt_lens, picked, decay=decay, kind=kind
    )
