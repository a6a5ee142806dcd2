"""``dartspec bench search``: tree-builder time per step and n-gram query throughput.

The draft rows are synthetic but shaped like a drafter's (a few likely tokens per depth over an
8,192-token draft vocabulary), so the numbers measure the search itself, not a model.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dartspec.drafters.base import DraftBudget
from dartspec.ngram import MergedNgram, NgramModel, OnlineNgram
from dartspec.search import BeamTree, ChainTree, DDTree


def synthetic_rows(depth: int = 8, vocab: int = 8192, seed: int = 0) -> torch.Tensor:
    """Log-probabilities ``(depth, vocab)`` with a peaked head, like a trained drafter's."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=g) * 2.0
    return torch.log_softmax(logits, dim=-1)


def _median_us(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def time_builders(
    sizes: Sequence[int], ngram: NgramModel | None, history: Sequence[int], repeats: int = 30
) -> dict[str, dict[int, float]]:
    """Median microseconds to build a tree of each size, per builder."""
    rows = synthetic_rows()
    d2t = np.arange(rows.shape[1]) + 100  # draft ids map to arbitrary target ids
    online = OnlineNgram(ngram.order if ngram is not None else 3)
    online.extend(history)
    builders: dict[str, Any] = {"beam": BeamTree(), "ddtree": DDTree(), "chain": ChainTree()}
    if ngram is not None:
        builders["beam+ngram"] = BeamTree(ngram=ngram)
        builders["beam+ngram, numpy"] = BeamTree(ngram=ngram)
        builders["beam+ngram, numpy"].use_c = False  # the reference search.c replaced (same trees)
        builders["beam+ngram+online"] = BeamTree(ngram=MergedNgram(ngram, online))
    builders["beam+online"] = BeamTree(ngram=online)
    out: dict[str, dict[int, float]] = {}
    for name, build in builders.items():
        out[name] = {}
        for r in sizes:
            budget = DraftBudget(max_nodes=r, max_depth=rows.shape[0])
            out[name][r] = _median_us(lambda b=build, bu=budget: b(7, rows, d2t, history, bu), repeats)
    return out


def ngram_queries_per_second(ngram: NgramModel, batch: int = 20, candidates: int = 25, repeats: int = 30) -> float:
    """Throughput of :meth:`NgramModel.prob` on beam-search-sized batches (contexts x candidates)."""
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, min(ngram.vocab, 2000), size=(batch, max(ngram.order - 1, 0)))
    cand = rng.integers(0, min(ngram.vocab, 2000), size=(batch, candidates))
    us = _median_us(lambda: ngram.prob(ctx, cand), repeats)
    return batch * candidates / (us / 1e6)


def report(sizes: Sequence[int], ngram_path: str | Path | None) -> str:
    ngram = NgramModel.load(ngram_path) if ngram_path else None
    history = list(np.random.default_rng(1).integers(0, 2000, size=300))
    timings = time_builders(sizes, ngram, history)
    lines = [
        "Tree build time per step (median microseconds; d = 8 rows over 8,192 draft tokens; "
        f"torch threads {torch.get_num_threads()})",
        "",
        "| builder | " + " | ".join(f"R={r}" for r in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for name, per in timings.items():
        lines.append(f"| {name} | " + " | ".join(f"{per[r]:.0f}" for r in sizes) + " |")
    if ngram is not None:
        qps = ngram_queries_per_second(ngram)
        lines += ["", f"n-gram queries: {qps / 1e6:.2f} M candidate probabilities per second (batches of 20 x 25)"]
    return "\n".join(lines)
