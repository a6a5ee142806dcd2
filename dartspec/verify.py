"""Lossless verification of a draft tree against the target's logits.

Greedy: follow the children whose token equals the target's argmax; the argmax at the last accepted
node is the bonus token. Sampling: at the current node draw ``y ~ p`` (the target's warped
distribution) and descend into the child carrying ``y`` if there is one, else emit ``y`` as the bonus.
Every committed token is therefore an exact draw from the target's distribution, whatever the drafter
proposed (method.md section 6, the "simpler equivalent form" of recursive rejection for a
deterministic tree).

Each committed token consumes exactly one uniform number from the verifier's generator, and tokens
are drawn by inverse CDF. So with a fixed seed, speculative sampling commits the same tokens as plain
sampling (up to float rounding between batched and single-token forwards): drafting changes speed,
never the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dartspec.errors import DartspecError
from dartspec.tree import Tree


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is warped; ``temperature == 0`` means greedy.

    The order is the one transformers uses: temperature, then top-k, then top-p.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise DartspecError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise DartspecError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise DartspecError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise DartspecError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and self.seed >= 0):
            raise DartspecError(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution over the vocabulary (float64, sums to 1) for one row of logits."""
    scores = logits.double() / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop[0] = False
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs


def sample(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw: the first token whose cumulative mass exceeds ``u * total``."""
    cdf = probs.cumsum(-1)
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True))
    return min(idx, probs.shape[-1] - 1)


@dataclass(frozen=True)
class Acceptance:
    """The outcome of verifying one tree.

    Attributes:
        path: accepted node indices from the root (always starts with 0).
        tokens: the newly committed tokens: the accepted draft tokens, then the bonus token.
    """

    path: list[int]
    tokens: list[int]

    @property
    def accepted_drafts(self) -> int:
        return len(self.path) - 1


class Verifier:
    """Accepts the longest path of a tree that the target would have produced itself."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = torch.Generator(device="cpu")
        self._rng.manual_seed(params.seed if params.seed is not None else torch.seed())

    def _uniform(self) -> float:
        return float(torch.rand((), generator=self._rng, dtype=torch.float64))

    def next_token(self, logits: torch.Tensor, argmax: torch.Tensor | None = None) -> int:
        """One token from one row of logits (used after prefill, where there is no tree); ``argmax``: the row's
        argmax where the runtime took it already."""
        if self.params.greedy:
            return int(logits.argmax() if argmax is None else argmax)
        return sample(warp(logits, self.params), self._uniform())

    def accept(self, tree: Tree, logits: torch.Tensor, argmax: torch.Tensor | None = None) -> Acceptance:
        """Walk ``tree`` with the target's ``logits`` (row i = distribution after node i); ``argmax``: each row's
        argmax where the runtime took it already (:attr:`TargetOutput.argmax`)."""
        greedy = None
        if self.params.greedy:
            greedy = (logits.argmax(-1) if argmax is None else argmax).tolist()
        node = 0
        path = [0]
        tokens: list[int] = []
        while True:
            token = greedy[node] if greedy is not None else self.next_token(logits[node])
            tokens.append(token)
            child = tree.child_with_token(node, token)
            if child is None:
                return Acceptance(path, tokens)
            node = child
            path.append(child)
