"""Where the batched data generator's time goes: `decode_batch` (dartspec/batch_decode.py) under torch.profiler.

    python3 scripts/profile_decode.py --device cuda --batches 256,1024,2048 --new-tokens 64 [--out profile.txt]

The first GPU window (2026-11-25, H100, bf16, transformers' modules) generated ~2.5k answer tokens/s at batch 256
where the goal is 30k: about 80 ms a decode step for a 135M model, so the step is bound by the host (Python, launches,
a read-back each step), not by the GPU. For each runtime (transformers' modules, and the lean forward with `--quant
none`, which runs on a GPU in plain PyTorch) this prints the answer tokens/s of decoding at each batch size of
`--batches` (a host-bound step costs about the same for 256 rows as for 1024), at the fastest of them the prefill's
seconds and a decode step's milliseconds with these prompts and with `--long-prompt-len` ones (the second window's
two-turn data ran at a twelfth of its short-prompt decode speed), the tokens/s of the trainer's batched
scoring (`score_batch`, 32 sequences), then, for the first batch size, the operators by self device time and by self
CPU time. On the first runtime it also times and profiles `--train-steps` trainer steps as the window trains
(`--train-config`, from the shipped drafter, on the committed data): the trainer made 22.7k-25.5k training tokens/s
on the H100 where the goal is 50k. `--out` also writes the speeds as JSON (runtime -> decode, decode_batch, score),
by which the window chooses the runtime and batch size of its data and training. Prompts: the prompts of the
committed dev shards (chat-formatted, as data generation sees them), cut to their last `--prompt-len` tokens.
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


def answers_of(target: Any, prompts: list[list[int]], sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """What ``target`` computes, to check one runtime against another: the first two greedy tokens of 64 prompts'
    answers (the second from a decode step: a CUDA-graph step is checked too), and the top-1 token at every real
    position of the scored sequences."""
    answers = decode_batch(target, prompts[:64], 2, stop_ids=frozenset())
    first = torch.tensor([t for a in answers for t in a.tokens])
    with torch.no_grad():
        top = target.score_batch(sequences).logits.argmax(-1).cpu()
    return {"decode": first, "score": torch.cat([top[i, : len(s)] for i, s in enumerate(sequences)])}


def check_agreement(
    got: dict[str, dict[str, torch.Tensor]], speeds: dict[str, dict[str, float]], lines: list[str], checked: set[str]
) -> None:
    """Drop the speed of a runtime's work where it disagrees with transformers' modules (the reference): a fast
    forward that computes something else would otherwise write the window's data or score its training. bf16
    kernels differ in rounding, which moves an argmax rarely, not for one answer in ten."""
    if "hf" not in got:
        return
    for runtime, answers in got.items():
        if runtime == "hf" or runtime in checked:
            continue
        checked.add(runtime)
        for work, least in (("decode", 0.9), ("score", 0.95)):
            agree = float((answers[work] == got["hf"][work]).double().mean())
            lines.append(f"{runtime} {work} agrees with hf on {agree:.3f} of its top-1 tokens (needs {least})")
            if agree < least:
                speeds.get(runtime, {}).pop(work, None)
                lines.append(f"{runtime} is not used for {work}: it computes something else than transformers")


def step_costs(target: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, float]:
    """Seconds of prefill and milliseconds a decode step for ``prompts`` in one batch: one token's decode (the
    prefill and a pick) against ``new_tokens`` tokens', each after a warm-up, the device drained around each; and
    the step's milliseconds in that warm-up, where shapes no earlier timing ran are new (the long prompts': a kernel
    that prepares itself per shape, as cuDNN's attention does, pays for it there, as in the data phase, whose
    shapes are always new)."""
    cuda = target.device.type == "cuda"

    def seconds(tokens: int) -> tuple[float, float]:
        def once() -> int:  # no stop tokens: every row runs every step
            decode_batch(target, prompts, tokens, stop_ids=frozenset())
            return 1

        first = 1 / timed(once, cuda)
        return first, 1 / timed(once, cuda)

    prefill = seconds(1)[1]
    first, warm = seconds(new_tokens)
    steps = max(new_tokens - 1, 1)
    return prefill, 1000 * (warm - prefill) / steps, 1000 * (first - prefill) / steps


def profile_runtime(
    target: Any, label: str, prompts: list[list[int]], sequences: list[list[int]], args: Any, lines: list[str]
) -> dict[str, float]:
    """Decode at each batch size and score with ``target``, timed, then decode profiled at the first batch size;
    the report's lines go to ``lines``; returns the best decode tokens/s, its batch size and the score tokens/s."""
    cuda = target.device.type == "cuda"
    batches = [int(b) for b in args.batches.split(",")]
    lines.append(f"== {target.name} on {target.device} ({label}), {args.new_tokens} new tokens")

    def decode(rows: int) -> Callable[[], int]:
        return lambda: sum(len(a.tokens) for a in decode_batch(target, prompts[:rows], args.new_tokens))

    def score() -> int:
        target.score_batch(sequences)
        return sum(len(t) for t in sequences)

    speed: dict[str, float] = {"decode": 0.0}
    for rows in batches:
        try:
            timed(decode(rows), cuda)  # warm-up (allocator, kernels' first launches)
            got = timed(decode(rows), cuda)
        except torch.OutOfMemoryError:
            lines.append(f"decode at batch {rows}: out of memory")
            break
        lines.append(f"decode at batch {rows}: {got:.0f} answer tokens/s")
        if got > speed["decode"]:
            speed["decode"], speed["decode_batch"] = got, rows
    # The second window's data phase decoded at a twelfth of the speed above: its second turns attend over ~770
    # slots, not ~200, and every step's shapes were new (cuDNN's attention, which it ran then, builds a graph per
    # shape: ~50 ms). Prefill and step time at the best batch, with these prompts and with prompts of
    # --long-prompt-len tokens (each row's prompt repeated to that length: the cost, not the text, is measured
    # here), warm and the first time, say whether the step grows with the attended width and with new shapes.
    rows = int(speed.get("decode_batch", batches[0]))
    long = [(p * (args.long_prompt_len // max(len(p), 1) + 1))[-args.long_prompt_len :] for p in prompts[:rows]]
    for key, label, batch in (
        ("step_ms_short", f"prompts of <= {args.prompt_len}", prompts[:rows]),
        ("step_ms_long", f"of {args.long_prompt_len}", long),
    ):
        try:
            prefill, speed[key], cold = step_costs(target, batch, args.new_tokens)
        except torch.OutOfMemoryError:
            lines.append(f"batch {rows}, {label} tokens: out of memory")
            break
        lines.append(
            f"batch {rows}, {label} tokens: prefill {prefill:.2f} s, {speed[key]:.1f} ms a decode step"
            f" ({cold:.1f} ms in the warm-up run)"
        )
    with torch.no_grad():
        timed(score, cuda)
        speed["score"] = timed(score, cuda)
        lines.append(f"score_batch ({len(sequences)} x <= {args.score_len} tokens): {speed['score']:.0f} tokens/s")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        got = timed(decode(batches[0]), cuda)
        lines.append(f"decode at batch {batches[0]}, profiled: {got:.0f} answer tokens/s (profiler overhead included)")
    print("\n".join(lines[-len(batches) - 5 :]), flush=True)
    table = prof.key_averages()
    if cuda:
        lines.append(table.table(sort_by="self_cuda_time_total", row_limit=20))
    lines.append(table.table(sort_by="self_cpu_time_total", row_limit=20))
    return speed


def profile_training(target: Any, args: Any, lines: list[str]) -> None:
    """A few trainer steps as the window trains (``--train-config``, from the shipped drafter, on the committed
    training data), timed and then profiled: where the trainer's time goes (the goal is 50k training tokens/s on an
    H100; the first window measured 22.7k-25.5k)."""
    import glob
    import tempfile

    from dartspec.train.cli import samples_from
    from dartspec.train.dart import DartTrainer, TrainConfig

    cuda = target.device.type == "cuda"
    folders = [d for d in sorted(glob.glob("data/smollm2-135m-*")) if not d.endswith("-dev")]
    cfg = TrainConfig.from_file(args.train_config)
    cfg.init = args.train_init
    with tempfile.TemporaryDirectory() as tmp:
        trainer = DartTrainer(target, samples_from(folders), [], tmp, cfg, log=lambda m: None)
        trainer.build()
        for _ in range(2):  # warm-up: allocator, kernels, autocast caches
            trainer.train_step()
        steps = [trainer.train_step() for _ in range(args.train_steps)]
        speed = sum(m["tokens_per_s"] for m in steps) / len(steps)
        lines.append(
            f"== trainer on {target.name} ({cfg.seqs_per_step} sequences a step, sorted in windows of "
            f"{trainer.sort_steps} steps): {speed:.0f} training tokens/s, "
            f"{sum(m['seconds'] for m in steps) / len(steps):.3f} s a step"
        )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.train_steps):
                trainer.train_step()
            if cuda:
                torch.cuda.synchronize()
    print(lines[-1], flush=True)
    table = prof.key_averages()
    if cuda:
        lines.append(table.table(sort_by="self_cuda_time_total", row_limit=25))
    lines.append(table.table(sort_by="self_cpu_time_total", row_limit=25))


def save(out: str | None, lines: list[str], speeds: dict[str, dict[str, float]]) -> None:
    """The report so far at ``out``, and the speeds beside it as JSON (what the window reads)."""
    if out:
        Path(out).write_text("\n".join(lines) + "\n")
        Path(out).with_suffix(".json").write_text(json.dumps(speeds) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--runtimes",
        default="lean,hf,lean+graphs",
        help="comma-separated runtimes to time and profile, in order; lean+graphs: the lean forward with its decode "
        "steps as CUDA graphs (--cuda-graphs; timed for decoding only: scoring is the same code)",
    )
    # 2048: the third window's lean decode still scaled with rows from 256 to 1024 (21k -> 76k tokens/s; its data
    # phase spent 40% of the time writing requests, ~12 ms a step whatever the rows), so a larger batch may pay.
    ap.add_argument("--batches", default="256,1024,2048", help="comma-separated batch sizes to time decoding at")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128, help="prompts cut to their last this many tokens")
    ap.add_argument("--long-prompt-len", type=int, default=640, help="prompt length of the long-context step timing")
    ap.add_argument("--score-batch", type=int, default=32, help="sequences per score_batch (the trainer's step)")
    ap.add_argument("--score-len", type=int, default=768)
    ap.add_argument("--dev", default="data/smollm2-135m-sharegpt-dev")
    ap.add_argument("--train-steps", type=int, default=3, help="trainer steps to time and profile (0: none)")
    ap.add_argument("--train-config", default="scripts/window.yaml", help="the trainer's settings")
    ap.add_argument("--train-init", default="dartspec/checkpoints/smollm2-135m-dart", help="the drafter to go on from")
    ap.add_argument("--out", default=None, help="write the report here (and the speeds beside it, as .json)")
    args = ap.parse_args()

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16  # as `data regenerate` loads it
    records = list(load_shards(args.dev))
    most = max(int(b) for b in args.batches.split(","))
    # The last --prompt-len tokens of each prompt (its end opens the answer): the requests the window's data phase
    # answers are short, and one length for every batch size keeps their speeds comparable.
    prompts = [r.tokens[max(0, r.prompt_len - args.prompt_len) : r.prompt_len].tolist() for r in records][:most]
    prompts = (prompts * (most // max(len(prompts), 1) + 1))[:most]
    sequences = [r.tokens[: args.score_len].tolist() for r in records[: args.score_batch]]
    cuda = args.device.startswith("cuda")
    lines: list[str] = []  # the report: what each runtime measured, or why it failed
    speeds: dict[str, dict[str, float]] = {}  # runtime -> decode, decode_batch, score (the window reads the .json)
    answers: dict[str, dict[str, torch.Tensor]] = {}  # runtime -> what it computed (checked against hf)
    checked: set[str] = set()

    runtimes = args.runtimes.split(",")
    for runtime in runtimes:
        name, _, extra = runtime.partition("+")
        quant = "none" if name == "lean" and cuda else "auto"
        try:
            target = load_target(
                args.model, device=args.device, runtime=name, quant=quant, dtype=dtype, cuda_graphs=extra == "graphs"
            )
            speeds[runtime] = profile_runtime(
                target, f"{runtime}, quant {quant}, {dtype}", prompts, sequences, args, lines
            )
            if extra == "graphs":
                speeds[runtime].pop("score", None)  # the trainer's scoring runs no graphs: the same as lean's
                graphs = target.step_graphs
                lines.append(
                    f"{runtime}: {graphs.captures} steps captured"
                    + (f"; capture FAILED, every step ran without graphs: {graphs.failed}" if graphs.failed else "")
                )
                if graphs.failed:
                    speeds.pop(runtime)  # what it timed was the lean forward without graphs
            answers[runtime] = answers_of(target, prompts, sequences)
        except Exception as err:  # a runtime that fails here is a finding: the next one still runs
            lines.append(f"== {runtime} (quant {quant}, {dtype}) failed: {type(err).__name__}: {err}")
            print(lines[-1], flush=True)
            save(args.out, lines, speeds)
            continue
        if args.train_steps and runtime == runtimes[0]:  # the trainer once, on the first runtime
            try:
                profile_training(target, args, lines)
            except Exception as err:
                lines.append(f"== trainer on {runtime} failed: {type(err).__name__}: {err}")
                print(lines[-1], flush=True)
        check_agreement(answers, speeds, lines, checked)  # each runtime once, as soon as hf's answers are in
        save(args.out, lines, speeds)  # after each runtime: a profile stopped by its time limit keeps what it measured
    if not args.out:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
