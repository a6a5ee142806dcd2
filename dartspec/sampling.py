"""What a request asks of the target's distribution (temperature, top-p, top-k, seed), checked without torch: the
command line refuses bad values before it imports anything heavy (:mod:`dartspec.verify` warps and samples with
them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dartspec.errors import DartspecError

__all__ = ["MAX_TOP_LOGPROBS", "SamplingParams", "check_logprobs"]

#: The most alternatives a token's log-probabilities list (OpenAI's ``top_logprobs`` limit).
MAX_TOP_LOGPROBS = 20


def check_logprobs(logprobs: object) -> None:
    """``logprobs`` asks for each token's log-probability with that many alternatives (None: none)."""
    if logprobs is not None and not (type(logprobs) is int and 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise DartspecError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {logprobs!r}")


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
