"""Teacher-forced per-depth accuracy of a drafter: is its top-1 at depth t the target's top-1?

The target scores a whole prompt + answer once; the drafter then predicts every answer position at
every depth from the true prefix (the same code path as the training loss, so training's dev metrics
and ``dartspec bench accuracy`` mean the same thing). A hit is what greedy verification accepts for a
chain drafted from the right prefix; ``chain_tau_est`` = 1 + sum_t prod_{s<=t} acc_s is the chain's
tokens per step if misses at different depths were independent (an estimate, not a measurement:
``dartspec bench`` measures tau).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dartspec.drafters.dart_model import DartModel
from dartspec.errors import DartspecError
from dartspec.runtime import pad_sequences
from dartspec.train.dart_loss import LossOutput, dart_anchor_loss

#: ``(features (B, T, F*H), next_embeds (B, T-1, H), target logits (B, T, V), lengths, prompt lengths,
#: generator) -> loss (mean over the B sequences) and per-depth hits``; sequence b fills its first lengths[b] rows.
Objective = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Sequence[int], Sequence[int], torch.Generator], LossOutput
]

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
    """The training objective of ``model``'s kind: DART's anchor blocks, DFlash's blocks or EAGLE-3's unrolled
    steps, each over all sequences of a batch in one drafter pass."""
    from dartspec.drafters.dflash_model import DFlashModel
    from dartspec.drafters.eagle3_model import Eagle3Model

    if isinstance(model, DFlashModel):
        from dartspec.train.dflash_loss import dflash_anchor_loss

        return lambda f, e, logits, lengths, prompt_lens, gen: dflash_anchor_loss(
            model, f, e, logits, lengths, prompt_lens, anchors=anchors, generator=gen, decay=decay, kind=kind
        )
    if isinstance(model, Eagle3Model):
        from dartspec.train.eagle3_loss import eagle3_loss

        return lambda f, e, logits, lengths, prompt_lens, gen: eagle3_loss(
            model, f, e, logits, lengths, prompt_lens, decay=decay, kind=kind
        )
    return lambda f, e, logits, lengths, prompt_lens, gen: dart_anchor_loss(
        model, f, e, logits, lengths, prompt_lens, anchors=anchors, generator=gen, decay=decay, kind=kind
    )


def batch_losses(
    target: Any,
    samples: Sequence[tuple[np.ndarray, int]],
    objectives: Sequence[Objective],
    generators: Sequence[torch.Generator],
) -> tuple[list[LossOutput], int] | None:
    """Score ``(tokens, prompt_len)`` samples with the target in one batched pass (no gradients) and apply each
    objective (with its own generator) to all of them at once: drafters reading the same feature layers share the
    target's pass. ``(losses, sequences scored)``, or None if none has anything to score."""
    keep = [(t.astype(np.int64), p) for t, p in samples if len(t) >= 4 and p < len(t)]
    if not keep:
        return None
    out = target.score_batch([t.tolist() for t, _ in keep])
    ids = pad_sequences([torch.from_numpy(t) for t, _ in keep], target.device)
    with torch.no_grad():
        next_embeds = target.embed(ids[:, 1:]).float()
    assert out.features is not None
    features = out.features.float()
    lengths, prompt_lens = [len(t) for t, _ in keep], [p for _, p in keep]
    # clone(): score_batch may hand out views of inference-mode buffers, which autograd refuses; each objective gets
    # its own copies (the logits are only read).
    losses = [
        objective(features.clone(), next_embeds.clone(), out.logits, lengths, prompt_lens, generator)
        for objective, generator in zip(objectives, generators, strict=True)
    ]
    return losses, len(keep)


def batch_loss(
    target: Any, samples: Sequence[tuple[np.ndarray, int]], objective: Objective, generator: torch.Generator
) -> tuple[LossOutput, int] | None:
    """:func:`batch_losses` for one objective: ``(loss, sequences scored)`` or None."""
    scored = batch_losses(target, samples, [objective], [generator])
    return None if scored is None else (scored[0][0], scored[1])


def depth_accuracy(
    target: Any,
    samples: Iterable[tuple[np.ndarray, int]],
    objective: Objective,
    *,
    depth: int,
    max_seq_len: int | None = None,
    seed: int = EVAL_SEED,
    batch: int = 1,
) -> DepthAccuracy:
    """Accuracy of the drafter behind ``objective`` on ``(tokens, prompt_len)`` samples (fixed seed), scoring
    ``batch`` sequences per forward (the same figures for any batch, up to rounding)."""
    return depth_accuracies(
        target, samples, [objective], depths=[depth], max_seq_len=max_seq_len, seed=seed, batch=batch
    )[0]


@torch.no_grad()
def depth_accuracies(
    target: Any,
    samples: Iterable[tuple[np.ndarray, int]],
    objectives: Sequence[Objective],
    *,
    depths: Sequence[int],
    max_seq_len: int | None = None,
    seed: int = EVAL_SEED,
    batch: int = 1,
) -> list[DepthAccuracy]:
    """:func:`depth_accuracy` of several drafters that read the same feature layers, on one target pass per batch
    (each objective with its own generator seeded ``seed``: the figures of separate calls). On a CPU the target's
    pass is most of the time: `train promote` scores the installed drafter and the candidate in about half."""
    gens = [torch.Generator().manual_seed(seed) for _ in objectives]
    correct = [np.zeros(d) for d in depths]
    count = [np.zeros(d) for d in depths]
    losses: list[list[float]] = [[] for _ in objectives]
    rows = iter(samples)
    while chunk := list(itertools.islice(rows, batch)):
        scored = batch_losses(target, [(t[:max_seq_len], p) for t, p in chunk], objectives, gens)
        if scored is None:
            continue
        results, n = scored
        for i, res in enumerate(results):
            correct[i] += res.per_depth_correct
            count[i] += res.per_depth_count
            losses[i] += [float(res.loss)] * n
    out = []
    for c, k, lost in zip(correct, count, losses, strict=True):
        acc = np.divide(c, k, out=np.zeros_like(c), where=k > 0)
        out.append(
            DepthAccuracy(
                top1=[float(a) for a in acc],
                scored=[int(v) for v in k],
                loss=float(np.mean(lost)) if lost else float("nan"),
                sequences=len(lost),
            )
        )
    return out


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


#: Drafter networks whose accuracy can be measured (and that `train promote` installs).
KINDS = ("dart", "eagle3", "dflash")


def load_drafter_model(kind: str, target: Any, path: str | None) -> Any:
    """The network of a ``dart`` or ``eagle3`` checkpoint (``path`` or the shipped one), float32."""
    from dartspec.drafters import checkpoint_folder
    from dartspec.drafters.dart_model import DartModel
    from dartspec.drafters.dflash_model import DFlashModel
    from dartspec.drafters.eagle3_model import Eagle3Model

    if kind not in KINDS:
        raise DartspecError(f"--drafter {kind!r}: accuracy is measured for {', '.join(KINDS)}")
    cls = {"dart": DartModel, "eagle3": Eagle3Model, "dflash": DFlashModel}[kind]
    model = cls.load(checkpoint_folder(kind, target, path), device=target.device, dtype=torch.float32, target=target)
    return model.eval()
