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
    device = features.device
    pieces = unroll(model, features, next_embeds, seq_len, prompt_len)
    per_loss, per_correct, per_count = [], [], []
    total = features.new_zeros((), dtype=torch.float32)
    for k, idx, hk in pieces:
        target_pos = idx + k
        scored = ((target_pos <= seq_len - 1) & (target_pos + 1 >= prompt_len)).nonzero().squeeze(1)
        if scored.numel() == 0:
            per_loss.append(0.0)
            per_correct.append(0)
            per_count.append(0)
            continue
        draft_logits = model.lm_head(model.norm(hk[scored]))
        per_row, correct = distill(draft_logits, target_logits[target_pos[scored]][:, model.d2t], kind)
        mean = per_row.mean()
        total = total + decay ** (k - 1) * mean
        per_loss.append(mean.detach())
        per_correct.append(correct.sum())
        per_count.append(scored.numel())
    # One host sync for all the per-step figures.
    loss_vals = [float(x) for x in torch.stack([torch.as_tensor(v, device=device).float() for v in per_loss]).tolist()]
    hits = [int(x) for x in torch.stack([torch.as_tensor(v, device=device) for v in per_correct]).tolist()]
    return LossOutput(total, loss_vals, hits, per_count)


def unroll(
    model: Eagle3Model, features: torch.Tensor, next_embeds: torch.Tensor, seq_len: int, prompt_len: int
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(step k, rows i, residual outputs)`` for k = 1..cfg.depth; step 1 covers every real row."""
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
    pieces: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, rows, hidden)
    pieces.append((1, rows, hidden))
    h = hidden[lo:]
    eye = torch.eye(n_sub, dtype=torch.bool, device=device)
    pad = torch.zeros(1, next_embeds.shape[1], dtype=next_embeds.dtype, device=device)
    padded = torch.cat([next_embeds, pad.expand(steps, -1)])
    for k in range(2, steps + 1):
        tok = padded[sub + k - 1]  # emb(x_{i+k}); zeros past the end (those rows are never scored)
        x_in, resid = model.node_inputs(h, tok)
        mask = torch.cat([causal[lo:], eye.repeat(1, k - 1)], dim=1)
        h = model.residual(x_in, resid, sub + k - 1, mask, cache=cache, tree=tree)
        pieces.append((k, sub, h))
    return pieces
