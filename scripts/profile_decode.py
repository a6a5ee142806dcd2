"""Where the batched data generator's time goes: `decode_batch` (dartspec/batch_decode.py) under torch.profiler.

    python3 scripts/profile_decode.py --device cuda --runtimes hf,lean --batch 256 --new-tokens 64 [--out profile.txt]

The first GPU window (2026-11-25, H100, bf16, transformers' modules) generated ~2.5k answer tokens/s at batch 256
where the goal is 30k: about 80 ms a decode step for a 135M model. For each runtime (transformers' modules, and the
lean forward with `--quant none`, which runs on a GPU in plain PyTorch but was never measured there) this prints
the answer tokens/s of a warm-up and of a profiled run, the tokens/s of the trainer's batched scoring
(`score_batch`, 32 sequences), then the operators by self device time and by self CPU time, so that the next window
can say whether the step is host-bound (Python, launches, syncs) or device-bound, and which runtime data generation
should use, before anything is changed. Prompts: the prompts of the committed dev shards (chat-formatted, as data
generation sees them).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dartspec.batch_decode import decode_batch
from dartspec.data.shards import load_shards
from dartspec.targets import load_target


def timed(work: Callable[[], int], cuda: bool) -> float:
    """Units of ``work`` per second, the device drained before and after."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    units = work()
    if cuda:
        torch.cuda.synchronize()
    return units / (time.perf_counter() - start)


def profile_runtime(
    target: Any, label: str, prompts: list[list[int]], sequences: list[list[int]], args: Any, lines: list[str]
) -> dict[str, float]:
    """Decode and score with ``target``, timed and then profiled; the report's lines go to ``lines``; returns the
    decode and score tokens/s."""
    cuda = target.device.type == "cuda"
    lines.append(f"== {target.name} on {target.device} ({label}), batch {len(prompts)}, {args.new_tokens} new tokens")

    def decode() -> int:
        return sum(len(a.tokens) for a in decode_batch(target, prompts, args.new_tokens))

    def score() -> int:
        target.score_batch(sequences)
        return sum(len(t) for t in sequences)

    lines.append(f"decode warm-up: {timed(decode, cuda):.0f} answer tokens/s")
    speed = {"decode": timed(decode, cuda)}
    lines.append(f"decode: {speed['decode']:.0f} answer tokens/s")
    with torch.no_grad():
        timed(score, cuda)
        speed["score"] = timed(score, cuda)
        lines.append(f"score_batch ({len(sequences)} x <= {args.score_len} tokens): {speed['score']:.0f} tokens/s")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        lines.append(f"decode, profiled: {timed(decode, cuda):.0f} answer tokens/s (profiler overhead included)")
    print("\n".join(lines[-4:]), flush=True)
    table = prof.key_averages()
    if cuda:
        lines.append(table.table(sort_by="self_cuda_time_total", row_limit=20))
    lines.append(table.table(sort_by="self_cpu_time_total", row_limit=20))
    return speed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--runtimes", default="hf,lean", help="comma-separated runtimes to time and profile")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--score-batch", type=int, default=32, help="sequences per score_batch (the trainer's step)")
    ap.add_argument("--score-len", type=int, default=768)
    ap.add_argument("--dev", default="data/smollm2-135m-sharegpt-dev")
    ap.add_argument("--out", default=None, help="write the report here (and the speeds beside it, as .json)")
    args = ap.parse_args()

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16  # as `data regenerate` loads it
    records = list(load_shards(args.dev))
    prompts = [r.tokens[: r.prompt_len].tolist() for r in records][: args.batch]
    prompts = (prompts * (args.batch // max(len(prompts), 1) + 1))[: args.batch]
    sequences = [r.tokens[: args.score_len].tolist() for r in records[: args.score_batch]]
    cuda = args.device.startswith("cuda")
    lines: list[str] = []  # the report: what each runtime measured, or why it failed
    speeds: dict[str, dict[str, float]] = {}  # runtime -> decode / score tokens/s (--out's .json: the window reads it)

    for runtime in args.runtimes.split(","):
        quant = "none" if runtime == "lean" and cuda else "auto"
        try:
            target = load_target(args.model, device=args.device, runtime=runtime, quant=quant, dtype=dtype)
            speeds[runtime] = profile_runtime(
                target, f"{runtime}, quant {quant}, {dtype}", prompts, sequences, args, lines
            )
        except Exception as err:  # a runtime that fails here is a finding: the next one still runs
            lines.append(f"== {runtime} (quant {quant}, {dtype}) failed: {type(err).__name__}: {err}")
            print(lines[-1], flush=True)
    report = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(report + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(speeds) + "\n")
    else:
        print(report)


if __name__ == "__main__":
    main()
