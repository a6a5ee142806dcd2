"""Rotary embedding in the layout dartspec's C kernels use: each head's q/k rows as adjacent pairs.

Llama-style checkpoints rotate pairs (j, j + D/2) of each head ("rotate half"); the fused attention
(``attend.c``) rotates adjacent pairs (2j, 2j + 1). Permuting each head's q and k projection rows once at
load moves one layout to the other, and leaves every query-key dot product unchanged (both sides get the
same permutation). The lean runtime and the DART drafter's CPU step both load their weights this way.
"""

from __future__ import annotations

import torch


def interleave_rows(rows: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Reorder each head's rows from the half-split rotary layout (j, j + D/2) to adjacent pairs."""
    perm = torch.arange(dim).reshape(2, dim // 2).T.reshape(-1)
    return rows.reshape(heads, dim, *rows.shape[1:])[:, perm].reshape(rows.shape)
