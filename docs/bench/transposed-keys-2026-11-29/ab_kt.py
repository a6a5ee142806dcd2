"""The C attention with the committed keys kept transposed in the cache (TreeKVCache's default) against transposing
them at every step (``transposed_keys=False``): the same kernels and target, two caches, interleaved in one process.

    python docs/bench/transposed-keys-2026-11-29/ab_kt.py --contexts 256,1500 --qs 1,2,4,8,16 --rounds 40 \
        --prompts docs/bench/cpu-default-dart-pld-2026-11-26/dev80.jsonl --limit 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from dartspec.drafters import make_drafter
from dartspec.engine import Generator
from dartspec.kv_cache import TreeKVCache
from dartspec.targets import load_target
from dartspec.tree import Tree

METHODS = {"ar": ("none", 1), "pld": ("pld", 4), "dart+pld:size=4": ("dart+pld", 4)}


def caches(t) -> dict[str, TreeKVCache]:
    return {"per step": TreeKVCache(t.num_layers, transposed_keys=False), "kept": TreeKVCache(t.num_layers)}


def verify_curve(t, qs: list[int], rounds: int, context: int) -> None:
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, 40000, size=context).tolist()
    cs = caches(t)
    for c in cs.values():
        t.prefill(prompt, cache=c)
    samples = {n: {q: [] for q in qs} for n in cs}
    for r in range(rounds):
        for name in list(cs)[:: 1 if r % 2 else -1]:
            c = cs[name]
            base = c.length
            for q in qs:
                tree = Tree.chain(7, rng.integers(10, 40000, size=q - 1).tolist())
                start = time.perf_counter()
                t.verify(tree, cache=c)
                samples[name][q].append(time.perf_counter() - start)
                c.truncate(base)
    med = {n: {q: statistics.median(v) for q, v in per.items()} for n, per in samples.items()}
    print(f"\nverify forwards after {context} positions, median of {rounds}")
    print("| keys | " + " | ".join(f"q={q}" for q in qs) + " |\n|---|" + "---|" * len(qs))
    for name in cs:
        print(f"| {name} | " + " | ".join(f"{med[name][q] * 1e3:.2f} ms" for q in qs) + " |")
    print("| kept / per step | " + " | ".join(f"{med['kept'][q] / med['per step'][q]:.3f}" for q in qs) + " |")


def generations(t, prompts: list[str], tokens: int) -> None:
    cs = caches(t)
    gens = {m: Generator(t, make_drafter(d, t) if d != "none" else None, tree_size=s) for m, (d, s) in METHODS.items()}
    rate = {(n, m): [] for n in cs for m in METHODS}
    outputs: dict[int, set] = {}
    for i, prompt in enumerate(prompts):
        for name in list(cs)[:: 1 if i % 2 else -1]:
            t.cache = cs[name]
            for m, g in gens.items():
                result = g.generate(prompt, chat=True, max_new_tokens=tokens)
                rate[name, m].append(result.stats.tokens_per_s)
                outputs.setdefault(i, set()).add(tuple(result.token_ids))
    print(f"\n{len(prompts)} prompts, {tokens} new tokens")
    print("| method | per step tok/s | kept tok/s | kept / per step (median per prompt) |\n|---|---|---|---|")
    for m in METHODS:
        old, new = rate["per step", m], rate["kept", m]
        gain = statistics.median(n / o for n, o in zip(new, old, strict=True))
        print(f"| {m} | {statistics.median(old):.1f} | {statistics.median(new):.1f} | {gain:.3f} |")
    print(f"\nevery method and cache gives the same tokens: {all(len(v) == 1 for v in outputs.values())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="256,1500")
    ap.add_argument("--qs", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--prompts")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    t = load_target("smollm2-135m")
    for context in map(int, args.contexts.split(",")):
        verify_curve(t, [int(q) for q in args.qs.split(",")], args.rounds, context)
    if args.prompts:
        lines = Path(args.prompts).read_text().splitlines()[: args.limit]
        generations(t, [json.loads(line)["prompt"] for line in lines], args.max_new_tokens)


if __name__ == "__main__":
    main()
