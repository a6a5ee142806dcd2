"""Shared-prefix attention (FlashForge) against per-request attention, on a real model's caches.

N requests share a system prompt of P tokens (from the prefix cache) and each has its own question; every step each
verifies a tree of R rows. The script times the attention of one decoder layer for all of them in one call
(``exact.attend_many``), with the shared pages read once for all (``share``) and with each request reading them
itself, interleaved, median over repeats; it also times whole batched steps (``verify_many``) both ways, and counts
the KV bytes each way reads from the cache per layer (by layout: shared pages once per group, own positions per
request), and the KV memory held against unshared.

    python scripts/shared_prefix_attention.py --requests 16 --prefix 512 --rows 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from dartspec import exact
from dartspec.targets import load_target
from dartspec.tree import Tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=512, help="shared tokens")
    ap.add_argument("--own", type=int, default=48, help="each request's own prompt tokens")
    ap.add_argument("--rows", type=int, default=1, help="rows each request verifies per step (a chain)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.model)
    target.enable_prefix_cache(1 << 30)
    rng = np.random.default_rng(0)
    head = rng.integers(100, 20000, size=args.prefix).tolist()
    prompts = [head + rng.integers(100, 20000, size=args.own).tolist() for _ in range(args.requests)]
    caches = [target.new_cache() for _ in prompts]
    for p, c in zip(prompts, caches, strict=True):
        target.prefill(p, cache=c)
    shared_tokens = caches[-1].layers[0].npre
    sizes = [args.rows] * args.requests
    masks = [None] * args.requests
    H, KV, D = target.heads, target.kv_heads, target.head_dim
    layer = target.layers[0]

    qkv = torch.randn(args.requests * args.rows, (H + 2 * KV) * D)
    positions = torch.cat([torch.arange(c.length, c.length + args.rows) for c in caches])
    rot = torch.view_as_real(target._rot[positions]).contiguous()

    def attention(share: bool) -> float:
        slots = target.sequence_slots(caches, sizes, masks)
        target.extend_layer(slots, 0, caches, sizes)
        started = time.perf_counter()
        exact.attend_many(qkv, H, KV, rot, slots, layer.q_norm, layer.k_norm, target.eps, target.scaling, share)
        seconds = time.perf_counter() - started
        for c, p in zip(caches, prompts, strict=True):
            c.layers[0].truncate(len(p))
        return seconds

    trees = [Tree.chain(p[-1], rng.integers(100, 20000, size=args.rows - 1).tolist()) for p in prompts]

    def step(share: bool) -> float:
        target.share_prefix_attention = share
        started = time.perf_counter()
        target.verify_many(list(zip(trees, caches, strict=True)))
        seconds = time.perf_counter() - started
        for c, p in zip(caches, prompts, strict=True):
            c.truncate(len(p))
        return seconds

    times: dict[str, list[float]] = {"attention shared": [], "attention each": [], "step shared": [], "step each": []}
    for share in (True, False):  # warm-up
        attention(share), step(share)
    for r in range(args.repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        for share in order:
            times["attention shared" if share else "attention each"].append(attention(share))
        for share in order:
            times["step shared" if share else "step each"].append(step(share))
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}

    position_bytes = 2 * KV * D * 4  # keys and values of one position in one layer
    total = [len(p) + args.rows for p in prompts]
    each = sum(total) * position_bytes
    shared = (shared_tokens + sum(t - shared_tokens for t in total)) * position_bytes
    held = (target.prefix_cache.nbytes / len(target.layers)) + sum(c.own_bytes() for c in caches) / len(target.layers)
    print(
        f"{args.requests} requests, {shared_tokens} shared tokens (of a {args.prefix}-token prefix), "
        f"{args.own} own, {args.rows} row(s) each, {torch.get_num_threads()} threads"
    )
    print(
        f"attention of one layer: shared {med['attention shared']:.3f} ms, each its own "
        f"{med['attention each']:.3f} ms: {med['attention each'] / med['attention shared']:.2f}x"
    )
    print(
        f"whole step ({len(target.layers)} layers): shared {med['step shared']:.2f} ms, each its own "
        f"{med['step each']:.2f} ms: {med['step each'] / med['step shared']:.2f}x"
    )
    print(
        f"KV bytes read per layer per step: shared {shared / 1e6:.2f} MB, each its own {each / 1e6:.2f} MB: "
        f"{each / shared:.2f}x"
    )
    unshared_held = sum(c.length * c.position_bytes() for c in caches) / len(target.layers)
    print(
        f"KV memory per layer: held {held / 1e6:.2f} MB (prefix cache + own), unshared {unshared_held / 1e6:.2f} MB: "
        f"{held / unshared_held:.0%}"
    )


if __name__ == "__main__":
    main()
