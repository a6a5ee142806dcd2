"""EAGLE-3's "training-time test" objective on a batch of sequences, unrolled in one pass per step.

Step 1 is DART's real-position pass: row i pairs fc(h_i) with emb(x_{i+1}), causal, and predicts
x_{i+2}. Step k >= 2 re-runs the layer on every row i as the depth-k node of a draft anchored at i:
the input pairs the row's own step k-1 residual output with emb(x_{i+k}) (the target's token, as on an
accepted path), at position i+k-1, and attends to the step-1 keys of positions <= i plus its own
earlier steps (a diagonal per step), exactly what drafting sees along a path. Row i at step k predicts
x_{i+k+1}, scored on the target's logits at position i+k. Gradients flow through the unrolled steps.

Sequences of a batch are right-padded to one width: every row's mask is the same (causal over the step-1 keys, a
diagonal over its own steps), a real row never sees the padding after it, and padding rows are never scored, so
each sequence's loss is what it gives alone (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dartspec.drafters.dart_model import DraftKV
from dartspec.drafters.eagle3_model import Eagle3Model
from dartspec.runtime import to_device
from dartspec.train.dart_loss import LossOutput, depth_summary, distill_rows


def first_scored_row(prompt_len: int, step: int) -> int:
    """The first row whose step ``step`` is trained: its prediction (target position row + step) must be an answer
    token, and from step 2 on only rows that can still be a drafting anchor's are unrolled (the prompt is context)."""
    return max(prompt_len - step - 1, 0 if step == 1 else max(prompt_len - 3, 0))


def eagle3_loss(
    model: Eagle3Model,
    features: torch.Tensor,
    next_embeds: torch.Tensor,
    target_logits: torch.Tensor,
    lengths: Sequence[int],
    prompt_lens: Sequence[int],
    *,
    decay: float = 0.8,
    kind: str = "kl",
) -> LossOutput:
    """Weighted per-step loss of the unrolled drafter, the mean over the batch's sequences (arguments as in
    :func:`dartspec.train.dart_loss.dart_loss`; sequence b fills its first ``lengths[b]`` rows)."""
    batch, width = features.shape[0], features.shape[1]
    steps = model.cfg.depth
    lo = min(first_scored_row(p, 2) for p in prompt_lens)
    pieces = unroll(model, features, next_embeds, width, lo)
    with torch.no_grad():  # the target's draft-vocabulary logits and top-1, once per position
        target_draft, target_top = target_logits[..., model.d2t], target_logits.argmax(-1)
    # Scored rows of every step, found on the host from the lengths (no read of the device): row i of sequence b at
    # step k scores target position i + k inside the sequence, from first_scored_row on. Each step's rows are taken
    # with index_select (its backward adds rows into place; advanced indexing's sorts the indices).
    picked, where = [], []
    for k, first, h in pieces:
        spans = [range(max(first_scored_row(p, k), first), n - k) for n, p in zip(lengths, prompt_lens, strict=True)]
        seq = np.concatenate([np.full(len(span), b, dtype=np.int64) for b, span in enumerate(spans)])
        row = np.concatenate([np.arange(span.start, span.stop, dtype=np.int64) for span in spans])
        if row.size:
            index = to_device(torch.from_numpy(seq * h.shape[1] + row - first), features.device)
            picked.append(h.flatten(0, 1).index_select(0, index))
            where.append(np.stack([seq, row + k, np.full_like(row, k)]))
    if not picked:
        zero = features.new_zeros((), dtype=torch.float32)
        return LossOutput(zero, torch.zeros(3, steps, device=features.device))
    seq, at, depth = to_device(torch.from_numpy(np.concatenate(where, axis=1)), features.device).unbind(0)
    per_row, correct = distill_rows(
        model.lm_head(model.norm(torch.cat(picked))), target_draft[seq, at], target_top[seq, at], model.d2t, kind
    )
    return depth_summary(per_row, correct, seq, depth, batch, steps, decay)


def unroll(
    model: Eagle3Model, features: torch.Tensor, next_embeds: torch.Tensor, seq_len: int, lo: int
) -> list[tuple[int, int, torch.Tensor]]:
    """``(step k, first row, residual outputs of rows first..seq_len-2)`` for k = 1..cfg.depth, of one sequence
    (``features (T, F*H)``) or a batch (``(B, T, F*H)``; outputs ``(B, rows, H)``).

    Step 1 covers every real row; later steps start at row ``lo`` (rows before it are never scored past step 1).
    """
    steps = model.cfg.depth
    n_real = seq_len - 1
    device = features.device
    rows = torch.arange(n_real, device=device)
    causal = rows[None, :] <= rows[:, None]
    cache = DraftKV()
    x_in, resid = model.real_inputs(features[..., :n_real, :], next_embeds[..., :n_real, :])
    hidden = model.residual(x_in, resid, rows, causal, cache=cache, keep=n_real)

    sub = rows[lo:]
    n_sub = sub.numel()
    tree = DraftKV()
    pieces: list[tuple[int, int, torch.Tensor]] = [(1, 0, hidden)]
    h = hidden[..., lo:, :]
    eye = torch.eye(n_sub, dtype=torch.bool, device=device)
    pad = next_embeds.new_zeros((*next_embeds.shape[:-2], steps, next_embeds.shape[-1]))
    padded = torch.cat([next_embeds, pad], dim=-2)
    for k in range(2, steps + 1):
        tok = padded[..., sub + k - 1, :]  # emb(x_{i+k}); zeros past the end (those rows are never scored)
        x_in, resid = model.node_inputs(h, tok)
        mask = torch.cat([causal[lo:], eye.repeat(1, k - 1)], dim=1)
        h = model.residual(x_in, resid, sub + k - 1, mask, cache=cache, tree=tree)
        pieces.append((k, lo, h))
    return pieces
