"""The C kernels of the working tree against those of a git revision, interleaved in one process.

`dartspec bench` compares methods on one build of the kernels; a kernel change needs both builds side by side
(timings on shared CPUs drift 2x between runs). This loads SmolLM2 twice, once per build, and alternates them:
verify forwards of q rows after 256 cached tokens (`--context`), then generations of development prompts per method.

    python scripts/kernel_ab.py --base HEAD~1 --qs 1,2,4,8,16 --rounds 60
    python scripts/kernel_ab.py --base HEAD~1 --prompts DEV.jsonl   # e.g. docs/bench/h200-window-3-2026-11-26/
                                                                    # after/cpu-pld-dev/dev_prompts.jsonl
    python scripts/kernel_ab.py --base fp32-scales ...              # this tree's kernels, fp32 scales as before
                                                                    # (a base whose Python no longer fits them)

The base's kernels run under the working tree's Python: a revision whose C structs or signatures differ cannot be
a base (its library would be called wrongly); compare layouts inside one build instead, as `fp32-scales` does.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

from dartspec import exact, lean
from dartspec.drafters import make_drafter
from dartspec.engine import Generator
from dartspec.targets import load_target
from dartspec.tree import Tree

METHODS = {"ar": ("none", 1), "pld": ("pld", 4), "dart:size=4": ("dart", 4), "dart+pld:size=4": ("dart+pld", 4)}


def load_builds(base: str, folder: Path) -> tuple[dict, dict]:
    """One target per build; each build's library is made current while its target runs (use_build)."""
    if base == "fp32-scales":
        return load_scale_layouts()
    for src in (*exact._SOURCES, *exact._HEADERS):
        shown = subprocess.run(
            ["git", "show", f"{base}:dartspec/{src.name}"], cwd=src.parent, capture_output=True, check=True
        )
        (folder / src.name).write_bytes(shown.stdout)
        if src.name == "qdot.h" and shown.stdout != src.read_bytes():
            # the structs the kernels take (qdot.h) changed: this tree's Python would hand the base's kernels the
            # wrong layouts (a crash, or numbers read from the wrong fields)
            raise SystemExit(
                f"{base}'s qdot.h differs from this tree's: its kernels cannot run under this Python. Compare from "
                "a worktree of a revision whose qdot.h is the base's, or inside one build (as --base fp32-scales does)"
            )
    builds = {
        base: (tuple(folder / s.name for s in exact._SOURCES), tuple(folder / h.name for h in exact._HEADERS)),
        "tree": (exact._SOURCES, exact._HEADERS),
    }
    libs, targets, build = {}, {}, exact._library
    for name, (sources, headers) in builds.items():
        exact._SOURCES, exact._HEADERS = sources, headers
        build.cache_clear()
        libs[name] = build()
        use_build(libs, name)
        targets[name] = load_target("smollm2-135m")
        bind_stack(targets[name], libs[name])
    return libs, targets


def bind_stack(target, lib) -> None:
    """Build the target's one-call forward (lean.py's BlockStack) now, under its own build: the stack takes the
    library current when it is made, lazily at the first forward, so a target first run under the other build would
    run that build's kernels (every A/B of the forward's kernels compared a build with itself until this check)."""
    stack = target._block_stack()
    fn, own = (ctypes.cast(f, ctypes.c_void_p).value for f in (stack._run, lib.dartspec_blocks))
    if fn != own:
        raise SystemExit("the target's forward is bound to the other build's kernels")


def load_scale_layouts() -> tuple[dict, dict]:
    """The working tree's kernels twice: weights with fp32 scales and offsets (packed afresh, not from the packed
    cache) against the default fp16 ones."""
    to_panels = exact.to_panels

    def fp32_panels(packed: exact.ExactWeight, panel: int | None = None) -> exact.ExactWeight:
        p = to_panels(packed, panel)
        return dataclasses.replace(p, scale=p.scale.float(), offset=None if p.offset is None else p.offset.float())

    lib = exact._library()
    libs = {"fp32-scales": lib, "tree": lib}
    with mock.patch.object(exact, "to_panels", fp32_panels), mock.patch.object(lean, "_packed_cache", lambda *a: None):
        base = load_target("smollm2-135m")
    return libs, {"fp32-scales": base, "tree": load_target("smollm2-135m")}


def use_build(libs: dict, name: str) -> None:
    exact._library = lambda: libs[name]  # the LM head and other per-call kernels look the library up each call


def verify_curve(libs: dict, targets: dict, qs: list[int], rounds: int, context: int = 256) -> None:
    rng = np.random.default_rng(0)
    for name, t in targets.items():
        use_build(libs, name)
        t.reset()
        t.prefill(rng.integers(10, 40000, size=context).tolist())
    samples = {n: {q: [] for q in qs} for n in targets}
    for r in range(rounds):
        for name in list(targets)[:: 1 if r % 2 else -1]:
            use_build(libs, name)
            t, base = targets[name], targets[name].cached
            for q in qs:
                tree = Tree.chain(7, rng.integers(10, 40000, size=q - 1).tolist())
                start = time.perf_counter()
                t.verify(tree)
                samples[name][q].append(time.perf_counter() - start)
                t.truncate(base)
    med = {n: {q: statistics.median(v) for q, v in per.items()} for n, per in samples.items()}
    old, new = list(targets)
    print("| build | " + " | ".join(f"q={q}" for q in qs) + " |\n|---|" + "---|" * len(qs))
    for name in targets:
        print(f"| {name} | " + " | ".join(f"{med[name][q] * 1e3:.2f} ms" for q in qs) + " |")
    print("| tree / base | " + " | ".join(f"{med[new][q] / med[old][q]:.3f}" for q in qs) + " |")


def generations(libs: dict, targets: dict, prompts: list[str], tokens: int) -> None:
    gens = {}
    for name, t in targets.items():
        use_build(libs, name)
        for m, (drafter, size) in METHODS.items():
            gens[name, m] = Generator(t, make_drafter(drafter, t) if drafter != "none" else None, tree_size=size)
            gens[name, m].generate("Hello", chat=True, max_new_tokens=8)  # warm-up
    rate = {k: [] for k in gens}
    outputs: dict[tuple[str, int], set] = {}
    for i, prompt in enumerate(prompts):
        for key in list(gens)[:: 1 if i % 2 else -1]:
            use_build(libs, key[0])
            result = gens[key].generate(prompt, chat=True, max_new_tokens=tokens)
            rate[key].append(result.stats.tokens_per_s)
            outputs.setdefault((key[0], i), set()).add(tuple(result.token_ids))
    old, new = list(targets)
    print("\n| method | base tok/s | tree tok/s | tree / base (median per prompt) |\n|---|---|---|---|")
    for m in METHODS:
        gain = statistics.median(n / o for n, o in zip(rate[new, m], rate[old, m], strict=True))
        print(f"| {m} | {statistics.median(rate[old, m]):.1f} | {statistics.median(rate[new, m]):.1f} | {gain:.3f} |")
    lossless = all(len(v) == 1 for v in outputs.values())
    agree = sum(outputs[old, i] == outputs[new, i] for i in range(len(prompts)))
    print(f"\nevery method equals plain decoding within each build: {lossless}; builds agree on {agree}/{len(prompts)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision whose kernels are the baseline")
    ap.add_argument("--qs", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the verify forwards")
    ap.add_argument("--prompts", help="a .jsonl of {'prompt': ...} to generate from (skipped if absent)")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libs, targets = load_builds(args.base, Path(tmp))
        verify_curve(libs, targets, [int(q) for q in args.qs.split(",")], args.rounds, args.context)
        if args.prompts:
            lines = Path(args.prompts).read_text().splitlines()[: args.limit]
            generations(libs, targets, [json.loads(line)["prompt"] for line in lines], args.max_new_tokens)


if __name__ == "__main__":
    main()
