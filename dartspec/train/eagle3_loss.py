"""EAGLE-3's "training-time test" objective on one sequence.

Step 1 is DART's real-position pass: row i pairs fc(h_i) with emb(x_{i+1}), causal, and predicts
x_{i+2}. Step k >= 2 re-runs the layer on every row i as the depth-k node of a draft anchored at i:
the input pairs the row's own step k-1 residual output with emb(x_{i+k}) (the target's token, as on an
accepted path), at position i+k-1, and attends to the step-1 keys of positions <= i plus its own
earlier steps (a diagonal per step), exactly what drafting sees along a path. Row i at step k predicts
x_{i+k+1}, scored on the target's logits at position i+k. Gradients flow through the unrolled steps.
"""

from __future__ import annotations

import torch

from dartspec.drafters.dart_model import DraftKV
from dartspec.drafters.eagle3_model import Eagle3Model
from dartspec.train.dart_loss import LossOutput, distill


def eagle3_loss(
    model: Eagle3Model,
    features: torch.Tensor,
    next_embeds: torch.Tensor,
    target_logits: torch.Tensor,
    prompt_len: int,
    *,
    decay: float = 0.8,
    kind: str = "kl",
) -> LossOutput:
    """Weighted per-step loss of the unrolled drafter (arguments as in :func:`dartspec.train.dart_loss.dart_loss`)."""
    seq_len = target_logits.shape[0]
    pieces = unroll(model, features, next_embeds, seq_len, prompt_len)
    zero = features.new_zeros((), dtype=torch.float32)
    total = zero
    stats = []  # per step: mean loss, top-1 hits, rows scored (device scalars: no read per sequence)
    for k, first, hk in pieces:
        # Row i scores target position i+k, inside the sequence and in the answer: a contiguous range of rows.
        lo, hi = max(prompt_len - k - 1, first), seq_len - 1 - k
        if hi < lo:
            stats.append(torch.stack([zero, zero, zero]))
            continue
        draft_logits = model.lm_head(model.norm(hk[lo - first : hi - first + 1]))
        per_row, correct = distill(draft_logits, target_logits[lo + k : hi + k + 1], model.d2t, kind)
        mean = per_row.mean()
        total = total + decay ** (k - 1) * mean
        stats.append(torch.stack([mean.detach(), correct.sum().float(), zero + (hi - lo + 1)]))
    return LossOutput(total, torch.stack(stats, dim=1))


def unroll(
    model: Eagle3Model, features: torch.Tensor, next_embeds: torch.Tensor, seq_len: int, prompt_len: int
) -> list[tuple[int, int, torch.Tensor]]:
    """``(step k, first row, residual outputs of rows first..T-2)`` for k = 1..cfg.depth.

    Step 1 covers every real row; later steps start where a row can still score an answer token.
    """
    steps = model.cfg.depth
    n_real = seq_len - 1
    device = features.device
    rows = torch.arange(n_real, device=device)
    causal = rows[None, :] <= rows[:, None]
    cache = DraftKV()
    x_in, resid = model.real_inputs(features[:n_real], next_embeds[:n_real])
    hidden = model.residual(x_in, resid, rows, causal, cache=cache, keep=n_real)

    # Rows that can score an answer token at some step >= 2 (the prompt only matters as context).
    lo = max(prompt_len - 3, 0)
    sub = rows[lo:]
    n_sub = sub.numel()
    tree = DraftKV()
    pieces: list[tuple[int, int, torch.Tensor]] = [(1, 0, hidden)]
    h = hidden[lo:]
    eye = torch.eye(n_sub, dtype=torch.bool, device=device)
    pad = torch.zeros(1, next_embeds.shape[1], dtype=next_embeds.dtype, device=device)
    padded = torch.cat([next_embeds, pad.expand(steps, -1)])
    for k in range(2, steps + 1):
        tok = padded[sub + k - 1]  # emb(x_{i+k}); zeros past the end (those rows are never scored)
        x_in, resid = model.node_inputs(h, tok)
        mask = torch.cat([causal[lo:], eye.repeat(1, k - 1)], dim=1)
        h = model.residual(x_in, resid, sub + k - 1, mask, cache=cache, tree=tree)
        pieces.append((k, lo, h))
    return pieces
