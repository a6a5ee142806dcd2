"""Engine-level speed of continuous batching (no server): N sequences stepped together with one target forward
per step (``Generator.advance_many``), against one at a time, on SmolLM2 with the default runtime.

    .venv/bin/python scripts/batch_engine_speed.py [--threads 2] [--drafter none]

Prints aggregate tokens/s and milliseconds per step for 1, 2, 4, 8 and 16 sequences (MT-Bench's first 16
prompts, chat template, greedy, 128 new tokens). A diagnostic for BENCHMARKS.md; the user-facing figure is
``dartspec bench serve``.
"""

from __future__ import annotations

import argparse
import time

import torch

from dartspec.bench.suite import load_prompts
from dartspec.drafters import make_drafter
from dartspec.engine import Generator
from dartspec.targets import load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default="none")
    ap.add_argument("--step-rows", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m")
    prompts = [text for _, text in load_prompts("mtbench", limit=16)]
    gen = Generator(target, make_drafter(args.drafter, target))
    base = None
    for n in (1, 2, 4, 8, 16):
        seqs = [gen.start(p, chat=True, max_new_tokens=128, own_state=True) for p in prompts[:n]]
        start, steps, live = time.perf_counter(), 0, list(seqs)
        while live:
            for seq in live:
                gen.emit(seq)
            live = [s for s in live if s.result is None]
            if live:
                gen.advance_many(live, step_rows=args.step_rows)
                steps += 1
        seconds = time.perf_counter() - start
        rate = sum(len(s.result.token_ids) for s in seqs) / seconds
        base = base or rate
        print(f"{n:2d} sequences: {rate:7.1f} tok/s ({rate / base:.2f}x), {1000 * seconds / steps:.2f} ms a step")


if __name__ == "__main__":
    main()
