"""Teacher-forced per-depth accuracy of a drafter: is its top-1 at depth t the target's top-1?

The target scores a whole prompt + answer once; the drafter then predicts every answer position at
every depth from the true prefix (the same code path as the training loss, so training's dev metrics
and ``dartspec bench accuracy`` mean the same thing). A hit is what greedy verification accepts for a
chain drafted from the right prefix; ``chain_tau_est`` = 1 + sum_t prod_{s<=t} acc_s is the chain's
tokens per step if misses at different depths were independent (an estimate, not a measurement:
``dartspec bench`` measures tau).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dartspec.drafters.dart_model import DartModel
from dartspec.train.dart_loss import LossOutput, dart_anchor_loss

#: ``(features, next_embeds, target logits, prompt_len, generator) -> loss and per-depth hits``
Objective = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Generator], LossOutput]

#: Samples are (prompt + answer token ids, prompt length) pairs; see :class:`dartspec.train.dart.Sample`.
EVAL_SEED = 12345


@dataclass(frozen=True)
class DepthAccuracy:
    """Per-depth top-1 agreement with the target over ``sequences`` sequences."""

    top1: list[float]
    scored: list[int]  # predictions scored per depth
    loss: float
    sequences: int

    @property
    def chain_tau_est(self) -> float:
        return float(1 + np.cumprod(self.top1).sum())

    def as_dict(self, prefix: str = "") -> dict[str, Any]:
        return {
            f"{prefix}loss": self.loss,
            f"{prefix}top1": [round(a, 4) for a in self.top1],
            f"{prefix}chain_tau_est": round(self.chain_tau_est, 3),
        }


def model_objective(model: DartModel, *, anchors: int, decay: float = 0.6, kind: str = "kl") -> Objective:
    """The training objective of ``model``'s kind: DART's anchor blocks, or EAGLE-3's unrolled steps."""
    from dartspec.drafters.eagle3_model import Eagle3Model

    if isinstance(model, Eagle3Model):
        from dartspec.train.eagle3_loss import eagle3_loss

        return lambda f, e, logits, prompt_len, gen: eagle3_loss(
            model, f, e, logits, prompt_len, decay=decay, kind=kind
        )
    return lambda f, e, logits, prompt_len, gen: dart_anchor_loss(
        model, f, e, logits, prompt_len, anchors=anchors, generator=gen, decay=decay, kind=kind
    )


def sequence_loss(
    target: Any, tokens: np.ndarray, prompt_len: int, objective: Objective, generator: torch.Generator
) -> LossOutput | None:
    """Score ``tokens`` with the target (no gradients) and apply ``objective``; None if nothing to score."""
    if len(tokens) < 4 or prompt_len >= len(tokens):
        return None
    out = target.score_sequence(tokens.astype(np.int64).tolist())
    ids = torch.from_numpy(tokens.astype(np.int64)).to(target.device)
    with torch.no_grad():
        next_embeds = target.embed(ids[1:]).float()
    # clone(): score_sequence may hand out views of inference-mode buffers, which autograd refuses.
    return objective(out.features.float().clone(), next_embeds.clone(), out.logits, prompt_len, generator)


@torch.no_grad()
def depth_accuracy(
    target: Any,
    samples: Iterable[tuple[np.ndarray, int]],
    objective: Objective,
    *,
    depth: int,
    max_seq_len: int | None = None,
    seed: int = EVAL_SEED,
) -> DepthAccuracy:
    """Accuracy of the drafter behind ``objective`` on ``(tokens, prompt_len)`` samples (fixed seed)."""
    gen = torch.Generator().manual_seed(seed)
    correct = np.zeros(depth)
    count = np.zeros(depth)
    losses = []
    for tokens, prompt_len in samples:
        res = sequence_loss(target, tokens[:max_seq_len], prompt_len, objective, gen)
        if res is None:
            continue
        correct += res.per_depth_correct
        count += res.per_depth_count
        losses.append(float(res.loss))
    acc = np.divide(correct, count, out=np.zeros_like(correct), where=count > 0)
    return DepthAccuracy(
        top1=[float(a) for a in acc],
        scored=[int(c) for c in count],
        loss=float(np.mean(losses)) if losses else float("nan"),
        sequences=len(losses),
    )


def greedy_samples(
    target: Any,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    progress: Callable[[Iterable[Any], int], Iterable[Any]] | None = None,
) -> list[tuple[np.ndarray, int]]:
    """The target's own greedy answers to tokenized ``prompts``: ``(prompt + answer ids, prompt length)``."""
    from dartspec.drafters import NoDrafter
    from dartspec.engine import Generator

    gen = Generator(target, NoDrafter())
    items = progress(prompts, len(prompts)) if progress else prompts
    out = []
    for ids in items:
        answer = gen.generate(ids, max_new_tokens=max_new_tokens, temperature=0.0).token_ids
        out.append((np.asarray(list(ids) + answer, dtype=np.int64), len(ids)))
    return out
