"""Where the batched data generator's time goes: `decode_batch` (dartspec/batch_decode.py) under torch.profiler.

    python3 scripts/profile_decode.py --device cuda --batch 256 --new-tokens 64 [--out profile.txt]

The first GPU window (2026-11-25, H100, bf16, transformers' modules) generated ~2.5k answer tokens/s at batch 256
where the goal is 30k: about 100 ms a decode step for a 135M model. This prints the answer tokens/s of an untimed
warm-up and a profiled run, then the operators by self device time and by self CPU time, so that the next window
can say whether the step is host-bound (Python, launches, syncs) or device-bound, before anything is changed.
Prompts: the first answers' prompts of the committed dev shards (chat-formatted, as data generation sees them).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from dartspec.batch_decode import decode_batch
from dartspec.data.shards import load_shards
from dartspec.targets import load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--runtime", default="auto")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dev", default="data/smollm2-135m-sharegpt-dev")
    ap.add_argument("--out", default=None, help="also write the report here")
    args = ap.parse_args()

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16  # as `data regenerate` loads it
    target = load_target(args.model, device=args.device, runtime=args.runtime, dtype=dtype)
    prompts = [r.tokens[: r.prompt_len].tolist() for r in load_shards(args.dev)][: args.batch]
    prompts = (prompts * (args.batch // max(len(prompts), 1) + 1))[: args.batch]
    what = f"{target.name} on {args.device} ({type(target).__name__})"
    lines = [f"{what}, batch {len(prompts)}, {args.new_tokens} new tokens"]

    def run() -> float:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        answers = decode_batch(target, prompts, args.new_tokens)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return sum(len(a.tokens) for a in answers) / (time.perf_counter() - start)

    lines.append(f"warm-up: {run():.0f} answer tokens/s")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        lines.append(f"profiled: {run():.0f} answer tokens/s (profiler overhead included)")
    table = prof.key_averages()
    if args.device.startswith("cuda"):
        lines.append(table.table(sort_by="self_cuda_time_total", row_limit=25))
    lines.append(table.table(sort_by="self_cpu_time_total", row_limit=25))
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
