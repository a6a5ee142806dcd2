"""Where a decode step's time goes on this host (forty-first session): the exact-a16 kernel's read speed on weights
too large for the caches and on one that stays in them, and a SmolLM2 verify step split into the fused decoder
blocks and the LM head, at 1-8 rows and 16-1,024 cached positions.

    .venv/bin/python docs/bench/intel-xeon-2026-11-29/where_time_goes.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from dartspec import exact
from dartspec.targets import load_target
from dartspec.tree import Tree


def weight(out: int, k: int, bits: int) -> exact.ExactWeight:
    """A random weight that is exactly 4-bit (Q4_1-like) or 8-bit (Q8_0-like) groups, in the kernel's panels."""
    g = torch.Generator().manual_seed(0)
    if bits == 4:
        q = torch.randint(0, 16, (out, k // 32, 32), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15
        d = (torch.rand(out, k // 32, 1, generator=g) * 0.01 + 0.001).half().float()
        m = (-torch.rand(out, k // 32, 1, generator=g) * 0.05).half().float()
        w = q * d + m
    else:
        q = torch.randint(-127, 128, (out, k // 32, 32), generator=g).float()
        q[..., 0] = 127
        w = q * (torch.rand(out, k // 32, 1, generator=g) * 0.01 + 0.001).half().float()
    packed = exact.pack(w.reshape(out, k))
    assert packed is not None
    return exact.to_panels(packed)


def kernel_speed() -> None:
    print("| weight | MB | rows | ms | GB/s |\n|---|---|---|---|---|")
    for out, k, bits in [(49152, 576, 4), (49152, 576, 8), (3072, 576, 4)]:
        packed = weight(out, k, bits)
        for rows in (1, 4):
            x = torch.randn(rows, k)
            reps = 30 if out > 10000 else 1000
            best = float("inf")
            for _ in range(5):
                for _ in range(3):
                    exact.linear_a16(x, packed)
                start = time.perf_counter()
                for _ in range(reps):
                    exact.linear_a16(x, packed)
                best = min(best, (time.perf_counter() - start) / reps)
            mb = packed.nbytes / 1e6
            print(
                f"| {out} x {k}, {bits}-bit | {mb:.1f} | {rows} | {best * 1e3:.3f} | {packed.nbytes / best / 1e9:.1f} |"
            )


def step_split() -> None:
    target = load_target("smollm2-135m")
    stack, head = target._block_stack(), target._c_head
    spent = {"blocks": 0.0, "head": 0.0}

    def timed(name: str, call):  # the instance's own call, timed
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = call(*args, **kwargs)
            spent[name] += time.perf_counter() - start
            return out

        return run

    type(stack).__call__ = timed("blocks", type(stack).__call__)
    type(head).__call__ = timed("head", type(head).__call__)
    rng = np.random.default_rng(0)
    print("\n| cached positions | rows | step ms | blocks ms | head ms |\n|---|---|---|---|---|")
    for ctx in (16, 256, 1024):
        target.reset()
        target.prefill(rng.integers(10, 40000, size=ctx).tolist())
        base = target.cached
        for q in (1, 2, 4, 8):
            spent.update(blocks=0.0, head=0.0)
            steps = []
            for _ in range(40):
                tree = Tree.chain(7, rng.integers(10, 40000, size=q - 1).tolist())
                start = time.perf_counter()
                target.verify(tree)
                steps.append(time.perf_counter() - start)
                target.truncate(base)
            print(
                f"| {ctx} | {q} | {statistics.median(steps) * 1e3:.2f} | {spent['blocks'] / 40 * 1e3:.2f} | "
                f"{spent['head'] / 40 * 1e3:.2f} |"
            )


if __name__ == "__main__":
    kernel_speed()
    step_split()
