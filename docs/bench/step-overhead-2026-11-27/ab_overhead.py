"""The step's host work cut (C top-k, C prompt lookup, C KV keep, the accepted path's feature rows as a view, Tree in
Python lists, no per-step detokenizing in ``generate``) against the code before, interleaved in one process.

Old is the same code with the earlier pieces patched back in (each C path's kernel getter returning None, so the
torch / numpy path runs, as it did; the list-indexed feature gather; ``Tree``'s per-node numpy loop; ``generate``
through ``stream``), switched before every decode.

Usage: python ab_overhead.py FIRST LAST [MODEL] (dev80.jsonl prompts FIRST..LAST-1; default SmolLM2-135M). Each
prompt is decoded greedily (128 new tokens) by plain decoding and by the CPU default (``auto``: for SmolLM2
``dart+pld``, 4 nodes, DART's share 3) old and new, in an order rotating by prompt; prints medians and IQRs of the
per-prompt speed ratios, median tau, the engine's phases (milliseconds a decoding step: draft, tree, verify, other),
and how many prompts' outputs differ.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from dartspec import engine, kv_cache, search, tree
from dartspec.drafters import pld
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target

DEV80 = Path(__file__).resolve().parent.parent / "cpu-default-dart-pld-2026-11-26" / "dev80.jsonl"


def tree_before(self: tree.Tree) -> None:
    """``Tree.__post_init__`` before: a numpy row copy per node."""
    tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
    parents = np.asarray(self.parents, dtype=np.int64).reshape(-1)
    q = len(tokens)
    if q > 1 and not ((parents[1:] >= 0) & (parents[1:] < np.arange(1, q))).all():
        raise ValueError("topological order")
    depth = np.zeros(q, dtype=np.int64)
    ancestors = np.zeros((q, q), dtype=bool)
    children: list[dict[int, int]] = [{} for _ in range(q)]
    ancestors[0, 0] = True
    for i in range(1, q):
        p = int(parents[i])
        depth[i] = depth[p] + 1
        ancestors[i] = ancestors[p]
        ancestors[i, i] = True
        children[p][int(tokens[i])] = i
    for name, value in (("tokens", tokens), ("parents", parents), ("depth", depth), ("ancestors", ancestors)):
        object.__setattr__(self, name, value)
    object.__setattr__(self, "_children", tuple(children))


def generate_before(self: engine.Generator, prompt, **kwargs):
    for event in self.stream(prompt, **kwargs):
        if event.result is not None:
            return event.result
    raise AssertionError


OLD = {
    (search, "_c_top_candidates"): lambda: None,
    (pld, "_c_lookup"): lambda: None,
    (kv_cache, "_c_kv_keep"): lambda: None,
    (engine, "_path_rows"): lambda features, path, drafter: features[path] if drafter.needs_features else None,
    (tree.Tree, "__post_init__"): tree_before,
    (tree.Tree, "max_depth"): property(lambda self: int(self.depth.max())),  # (a later change keeps it)
    (engine.Generator, "generate"): generate_before,
}


def label(run: tuple[str, bool]) -> str:
    return f"{run[0]}_{'old' if run[1] else 'new'}"


@contextmanager
def code(patches: dict, old: bool):
    """``patches`` (owner, attribute) -> the old value applied while ``old``, the current ones restored after."""
    new = {key: key[0].__dict__[key[1]] for key in patches}
    for (owner, name), value in (patches if old else new).items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in new.items():
            setattr(owner, name, value)


def run(patches: dict, first: int, last: int, model: str = "smollm2-135m") -> None:
    prompts = [json.loads(line)["prompt"] for line in DEV80.read_text().splitlines()][first:last]
    target = load_target(model)
    gens = {"ar": build_generator(target, GeneratorSpec()), "auto": build_generator(target, GeneratorSpec("auto"))}
    runs = [(name, old) for name in gens for old in (True, False)]
    for name, old in runs:  # warm-up
        with code(patches, old):
            gens[name].generate(prompts[0], chat=True, max_new_tokens=8)
    speed: dict[tuple[str, bool], list[float]] = {run: [] for run in runs}
    taus: dict[tuple[str, bool], list[float]] = {run: [] for run in runs}
    phases: dict[tuple[str, bool], dict[str, float]] = {run: {} for run in runs}  # seconds, summed
    steps: dict[tuple[str, bool], int] = {run: 0 for run in runs}
    differ = 0
    for i, prompt in enumerate(prompts):
        seen = set()
        for name, old in runs[i % len(runs) :] + runs[: i % len(runs)]:
            with code(patches, old), torch.inference_mode():
                start = time.perf_counter()
                result = gens[name].generate(prompt, chat=True, max_new_tokens=128)
                speed[name, old].append(len(result.token_ids) / (time.perf_counter() - start))
            taus[name, old].append(result.stats.tau)
            steps[name, old] += result.stats.target_forwards - 1
            for phase, seconds in result.stats.times.items():
                phases[name, old][phase] = phases[name, old].get(phase, 0.0) + seconds
            seen.add(tuple(result.token_ids))
        differ += len(seen) > 1
    pairs = ((("ar", False), ("ar", True)), (("auto", False), ("auto", True)))
    pairs += ((("auto", True), ("ar", True)), (("auto", False), ("ar", False)))
    for a, b in pairs:
        ratio = np.array(speed[a]) / np.array(speed[b])
        q1, q3 = np.percentile(ratio, [25, 75])
        print(f"{label(a)} / {label(b)}: median {np.median(ratio):.3f}x IQR {q1:.3f}-{q3:.3f}")
    for run in runs:
        per_step = ", ".join(f"{k} {1000 * v / steps[run]:.2f}" for k, v in phases[run].items() if k != "prefill")
        print(f"{label(run)}: {np.median(speed[run]):.1f} tok/s, tau {np.median(taus[run]):.3f}; ms a step: {per_step}")
    print("prompts whose four outputs differ:", differ)


if __name__ == "__main__":
    run(OLD, int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:4])
