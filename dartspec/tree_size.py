"""``--tree-size auto``: pick the draft tree size that maximises expected tokens per second.

Verifying R tree nodes costs T(R), measured once per machine, model, device, dtype and thread count
(cached as JSON). At each step the drafter's tree is built at the largest size, every node gets an
acceptance estimate (the product of the draft probabilities along its path), and the tree is cut to
the R whose expected committed tokens, 1 + sum of the R-1 best estimates, per second of
T(R) + drafting overhead is largest. Raw draft probabilities are over- or under-confident, so the
estimates are scaled by a running ratio of accepted to predicted draft tokens.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dartspec import atomic
from dartspec.runtime import describe, sync
from dartspec.tree import DraftBudget, Tree

#: The largest tree ``--tree-size auto`` considers (the engine's budget in auto mode).
AUTO_MAX_SIZE = 32

#: Tree sizes timed by the calibration; costs in between are interpolated.
CALIBRATION_QS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one verification of q tree nodes, at the calibrated sizes."""

    qs: tuple[int, ...]
    seconds: tuple[float, ...]

    def cost(self, q: int | np.ndarray) -> np.ndarray:
        """Interpolated seconds for ``q`` nodes; past the largest calibrated size, the last segment's slope goes on
        (rows keep costing), below the smallest the first size's cost."""
        q = np.asarray(q, dtype=np.float64)
        slope = (self.seconds[-1] - self.seconds[-2]) / (self.qs[-1] - self.qs[-2]) if len(self.qs) > 1 else 0.0
        past = np.maximum(q - self.qs[-1], 0.0) * max(slope, 0.0)
        return np.interp(q, self.qs, self.seconds) + past

    def as_dict(self) -> dict[str, float]:
        return {str(q): round(s * 1000, 2) for q, s in zip(self.qs, self.seconds, strict=True)}


def verify_cost_curve(
    targets: dict[str, Any], qs: list[int], ctx: int, repeats: int, seed: int = 0
) -> dict[str, dict[int, float]]:
    """Median seconds of one ``verify`` of a q-node chain after ``ctx`` cached tokens, per named runtime.

    The runtimes take turns round by round (timings on shared CPUs drift), each in a fresh random order of
    q (slow drift would otherwise bias the later sizes); round 0 only warms caches and allocators.
    """
    rng = np.random.default_rng(seed)
    samples: dict[str, dict[int, list[float]]] = {name: {q: [] for q in qs} for name in targets}
    for target in targets.values():
        target.reset()
        target.prefill(rng.integers(10, target.vocab_size - 1, size=ctx).tolist())
    try:
        for round_ in range(repeats + 1):
            names = list(targets) if round_ % 2 == 0 else list(targets)[::-1]
            for name in names:
                target = targets[name]
                base = target.cached
                for q in (int(x) for x in rng.permutation(qs)):
                    tree = Tree.chain(7, rng.integers(10, target.vocab_size - 1, size=q - 1).tolist())
                    sync(target.device)
                    start = time.perf_counter()
                    target.verify(tree)
                    sync(target.device)
                    if round_ > 0:
                        samples[name][q].append(time.perf_counter() - start)
                    target.truncate(base)
    finally:
        for target in targets.values():
            target.reset()
    return {name: {q: statistics.median(v) for q, v in per_q.items()} for name, per_q in samples.items()}


def calibration_file(target: Any, cache: Path, what: str = "") -> Path:
    """Where a measurement of ``target`` on this machine is cached: the verify cost curve (``what`` empty) or another
    one named by ``what``, keyed by model, device, runtime, weight format, threads, CPU and kernel build."""
    cpu = platform.processor() or platform.machine()
    fmt = describe(target)
    key = f"{target.name}-{target.device}-{fmt.replace('/', '-')}-t{torch.get_num_threads()}"
    key += f"-{cpu}-{os.cpu_count()}-v3"  # v3: keyed by runtime and weight format
    if "exact" in fmt or "fp16" in fmt:  # on dartspec's C kernels: a new build, a new curve
        from dartspec import exact

        key += f"-k{exact.build_key()}"
    key += f"-{what}" if what else ""
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in key)
    return cache / "calibration" / f"{safe}.json"


def calibrate(target: Any, *, cache: Path | None = None, repeats: int = 9, ctx: int = 256, log=None) -> CostCurve:
    """The target's verify cost curve on this machine, measured once and cached."""
    from dartspec.assets import cache_dir

    path = calibration_file(target, cache or cache_dir())
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            return CostCurve(tuple(data["qs"]), tuple(data["seconds"]))
        except (ValueError, KeyError, TypeError):
            path.unlink(missing_ok=True)  # a damaged cache entry is simply measured again
    if log:
        log(f"calibrating the verify cost curve of {target.name} on this machine (once)...")
    curve = verify_cost_curve({"target": target}, list(CALIBRATION_QS), ctx, repeats)["target"]
    # Not forced monotone: on some CPUs 4 rows really are cheaper than 3 (GEMM kernel shapes), and
    # clamping them up made the sizer avoid the best small trees.
    result = CostCurve(CALIBRATION_QS, tuple(float(curve[q]) for q in CALIBRATION_QS))
    atomic.write_text(path, json.dumps({"qs": list(result.qs), "seconds": list(result.seconds)}))
    return result


def node_estimates(tree: Tree, logp: torch.Tensor, t2d: np.ndarray) -> np.ndarray:
    """Product of draft probabilities along each node's path (root = 1); ``logp`` is ``(depth, Vd)``."""
    probs = np.ones(tree.size)
    if tree.size == 1:
        return probs
    lp = logp.float().cpu().numpy()
    for i in range(1, tree.size):
        d = int(tree.depth[i]) - 1
        k = t2d[int(tree.tokens[i])] if int(tree.tokens[i]) < len(t2d) else -1
        p = float(np.exp(lp[d, k])) if k >= 0 and d < lp.shape[0] else 0.0
        probs[i] = probs[int(tree.parents[i])] * p
    return probs


@dataclass
class AutoSizer:
    """Cuts each proposed tree to the size with the best expected tokens per second."""

    curve: CostCurve
    overhead_s: float = 0.0  # drafting + search time per step, updated by the drafter
    scale: float = 1.0
    predicted: float = 0.0
    accepted: float = 0.0
    chosen: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # the chosen trees' depths

    def begin(self) -> None:
        """A new generation: the size history restarts, the learned calibration is kept."""
        self.chosen, self.depths = [], []

    def choose(self, tree: Tree, estimates: np.ndarray, beside: int = 0) -> tuple[Tree, float]:
        """The best prefix of the nodes ranked by estimate; returns the cut tree and its expected gain. ``beside``:
        nodes verified with the tree that are not the drafter's (lookup spans), counted in the cost."""
        order = sorted(range(1, tree.size), key=lambda i: (-estimates[i], i))  # parents rank before children
        p = np.minimum(1.0, estimates[order] * self.scale)
        sizes = np.arange(1, tree.size + 1)
        gain = 1.0 + np.concatenate([[0.0], np.cumsum(p)])
        rate = gain / (self.curve.cost(sizes + beside) + self.overhead_s)
        best = int(np.argmax(rate))
        cut = tree.subtree(order[:best])
        self.chosen.append(best + 1)
        self.depths.append(cut.max_depth)
        self.predicted += float(gain[best] - 1.0)
        return cut, float(gain[best])

    def draft_budget(self, budget: DraftBudget) -> DraftBudget:
        """``budget`` narrowed to what the recent choices could use: twice the largest of the last 16 sizes (at
        least 4 nodes; 8 before any choice) and one level below the deepest. Drafting the full 32 nodes at depth 8
        and cutting to the 2-4 a CPU can afford cost more than the cut saved (2026-12-06: drafting 13% of the time,
        the search 6-7%, against 10% / 2% at a fixed 4 nodes); a run of choices at the ceiling doubles it."""
        recent, deep = self.chosen[-16:], self.depths[-16:]
        nodes = max(4, 2 * max(recent)) if recent else 8
        depth = max(2, max(deep) + 1) if deep else budget.max_depth
        return replace(budget, max_nodes=min(budget.max_nodes, nodes), max_depth=min(budget.max_depth, depth))

    def worth_growing(self, estimates: np.ndarray, bound: float, new_nodes: int, extra_s: float) -> bool:
        """Could up to ``new_nodes`` more nodes, none estimated above ``bound``, beat the best rate of the
        tree so far (``estimates``, root first) after ``extra_s`` more drafting? An upper bound: a drafter
        that grows its tree level by level stops once the answer is no."""
        p = np.sort(np.minimum(1.0, np.asarray(estimates[1:]) * self.scale))[::-1]
        gain = 1.0 + np.concatenate([[0.0], np.cumsum(p)])
        rate = gain / (self.curve.cost(np.arange(1, len(gain) + 1)) + self.overhead_s)
        best = int(np.argmax(rate))
        more = np.arange(1, new_nodes + 1)
        grown = (gain[best] + more * min(1.0, bound * self.scale)) / (
            self.curve.cost(best + 1 + more) + self.overhead_s + extra_s
        )
        return bool(new_nodes > 0 and grown.max() > rate[best])

    def cut(self, tree: Tree, estimates: np.ndarray, drafting_s: float, beside: int = 0) -> Tree:
        """:meth:`choose`, then fold this step's drafting time into the overhead (a running average)."""
        tree, _ = self.choose(tree, estimates, beside)
        self.overhead_s = drafting_s if not self.overhead_s else 0.9 * self.overhead_s + 0.1 * drafting_s
        return tree

    def observe(self, accepted_drafts: int) -> None:
        self.accepted += accepted_drafts
        # Shrink towards 1 until there is evidence; clamp so one odd prompt cannot run away.
        self.scale = float(np.clip((self.accepted + 2.0) / (self.predicted + 2.0), 0.2, 3.0))

    def report(self) -> dict[str, Any]:
        """What ``--json`` shows under ``tree_size_auto``."""
        sizes = self.chosen or [1]
        return {
            "mean_size": round(float(np.mean(sizes)), 2),
            "sizes": {str(k): int(v) for k, v in zip(*np.unique(sizes, return_counts=True), strict=True)},
            "cost_ms": self.curve.as_dict(),
            "overhead_ms": round(self.overhead_s * 1000, 2),
            "calibration_scale": round(self.scale, 3),
            "why": "R maximises (1 + sum of the R-1 best path-probability estimates) / (T(R) + draft time)",
        }


def auto_sizer(target: Any, wanted: bool) -> AutoSizer | None:
    """The ``--tree-size auto`` policy on this machine's verify cost curve (measured once, cached), if ``wanted``."""
    return AutoSizer(calibrate(target)) if wanted else None
