"""``dartspec bench latency``: what a target forward costs, and plain decoding against transformers.

Two measurements, both interleaved in one process (timings on shared CPUs drift up to 2x, so only
ratios taken side by side mean anything):

1. The verify cost curve T(q)/T(1): one forward of a q-node tree over a cached context, for every
   runtime and weight format (transformers fp32, lean fp32 / fp16 / int8), alternating rounds.
2. Plain greedy decoding (``--drafter none``) against ``transformers`` ``generate`` on MT-Bench
   prompts: same prompts back to back, alternating order, tokens compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dartspec.engine import Generator, sync
from dartspec.errors import DartspecError
from dartspec.targets import describe, wrap_format
from dartspec.tree_size import verify_cost_curve


def plain_vs_transformers(
    target: Any, prompts: list[str], max_new_tokens: int, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Per prompt: seconds and tokens of dartspec plain decoding and of transformers ``generate``."""
    from transformers import AutoModelForCausalLM

    # The text config names the folder (target.model would build a transformers model only to read it), except in a
    # multimodal model's
    folder = target.config._name_or_path or target.model.config._name_or_path
    # A separate, untouched model: transformers' own generate with stock layers and its DynamicCache.
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=target.dtype, attn_implementation="sdpa")
    hf_model = hf_model.to(target.device).eval()
    gen = Generator(target)

    def run_dartspec(ids: list[int]) -> tuple[float, list[int]]:
        start = time.perf_counter()
        result = gen.generate(ids, max_new_tokens=max_new_tokens)
        return time.perf_counter() - start, result.token_ids

    def run_hf(ids: list[int]) -> tuple[float, list[int]]:
        input_ids = torch.tensor([ids], device=target.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=sorted(target.eos_token_ids),
                pad_token_id=min(target.eos_token_ids),
            )
        sync(target.device)
        return time.perf_counter() - start, out[0, len(ids) :].tolist()

    rows = []
    for i, prompt in enumerate(prompts):
        ids = target.encode_chat([{"role": "user", "content": prompt}])
        run_dartspec(ids), run_hf(ids)  # warm-up on this prompt
        times: dict[str, list[float]] = {"dartspec": [], "hf": []}
        tokens: dict[str, list[int]] = {}
        pair = [("dartspec", run_dartspec), ("hf", run_hf)]
        for round_ in range(2):
            for name, fn in pair if (i + round_) % 2 == 0 else pair[::-1]:
                seconds, toks = fn(ids)
                times[name].append(seconds)
                tokens[name] = toks
        row = {
            "prompt": i,
            "dartspec_s": min(times["dartspec"]),
            "hf_s": min(times["hf"]),
            "dartspec_tokens": len(tokens["dartspec"]),
            "hf_tokens": len(tokens["hf"]),
            "identical": tokens["dartspec"] == tokens["hf"],
        }
        row["dartspec_tok_s"] = row["dartspec_tokens"] / row["dartspec_s"]
        row["hf_tok_s"] = row["hf_tokens"] / row["hf_s"]
        row["speed_ratio"] = row["dartspec_tok_s"] / row["hf_tok_s"]
        log(
            f"prompt {i}: dartspec {row['dartspec_tok_s']:.1f} tok/s, transformers {row['hf_tok_s']:.1f} tok/s, "
            f"ratio {row['speed_ratio']:.2f}, identical tokens: {row['identical']}"
        )
        rows.append(row)
    return rows


def plot_cost_curve(curve: dict[str, dict[int, float]], path: str | Path) -> None:
    """PNG of T(q) per runtime, relative to the first runtime's T(1)."""
    from dartspec.plotting import pyplot

    plt = pyplot("plotting (--plot)")

    first = next(iter(curve.values()))
    ref1 = first[min(first)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, per_q in curve.items():
        qs = sorted(per_q)
        ax.plot(qs, [per_q[q] / ref1 for q in qs], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree nodes verified in one forward (q)")
    ax.set_ylabel(f"forward time / {next(iter(curve))} T(1)")
    ax.set_title("Verify cost curve")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_report(curve: dict[str, dict[int, float]], plain: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    qs = sorted(next(iter(curve.values())))
    ref = next(iter(curve))
    lines = [
        f"## Verify cost curve: {meta['model']}, {meta['device']}, {meta['threads']} threads, context {meta['ctx']}",
        "",
        "| runtime | " + " | ".join(f"q={q}" for q in qs) + " |",
        "|---|" + "---|" * len(qs),
    ]
    for mode, per_q in curve.items():
        t1 = per_q[qs[0]]
        cells = [f"{per_q[q] * 1e3:.1f} ms ({per_q[q] / t1:.2f}x)" for q in qs]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Ratios in parentheses are T(q)/T(1) within a row. T(1) against {ref}'s: "
        + ", ".join(f"{name} {per_q[qs[0]] / curve[ref][qs[0]]:.2f}x" for name, per_q in curve.items()),
    ]
    if plain:
        ratios = [r["speed_ratio"] for r in plain]
        lines += [
            "",
            f"## Plain greedy decoding vs transformers generate ({len(plain)} MT-Bench prompts, "
            f"{meta['max_new_tokens']} new tokens)",
            "",
            "| prompt | dartspec tok/s | transformers tok/s | ratio | identical tokens |",
            "|---|---|---|---|---|",
        ]
        for r in plain:
            same = "yes" if r["identical"] else "NO"
            lines.append(
                f"| {r['prompt']} | {r['dartspec_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['speed_ratio']:.2f} | {same} |"
            )
        lines += ["", f"Median ratio (dartspec / transformers): {statistics.median(ratios):.2f}x"]
    return "\n".join(lines) + "\n"


def run_latency_bench(args: argparse.Namespace, target: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """The ``bench latency`` command: measure, print a Markdown report, optionally save it."""
    if args.ctx + max(args.qs) > target.max_context:  # a tree past the context filled all memory before
        raise DartspecError(
            f"--ctx {args.ctx} with --qs {max(args.qs)} is {args.ctx + max(args.qs)} positions: more than the "
            f"{target.max_context} of {args.model}'s context window"
        )
    meta = {
        "model": args.model,
        "device": str(target.device),
        "threads": torch.get_num_threads(),
        "ctx": args.ctx,
        "max_new_tokens": args.max_new_tokens,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    runtimes = {describe(target): target}
    for item in args.formats or []:
        other = wrap_format(target, item)
        runtimes.setdefault(describe(other), other)
    log(f"timing verify forwards of {', '.join(runtimes)} for q in {args.qs} ({args.repeats} interleaved rounds)...")
    curve = verify_cost_curve(runtimes, args.qs, args.ctx, args.repeats)
    plain: list[dict[str, Any]] = []
    if args.prompts and not args.skip_hf:
        from dartspec.data.sources import load_mtbench

        prompts = [q["turns"][0] for q in load_mtbench()[: args.prompts]]
        log(f"plain decoding vs transformers generate on {len(prompts)} MT-Bench prompts...")
        plain = plain_vs_transformers(target, prompts, args.max_new_tokens, log)
    report = format_report(curve, plain, meta)
    print(report)
    data = {"meta": meta, "verify_cost_s": {m: {str(q): t for q, t in c.items()} for m, c in curve.items()}}
    data["plain_vs_transformers"] = plain
    if args.plot:
        plot_cost_curve(curve, args.plot)
        log(f"wrote {args.plot}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "latency.md").write_text(report)
        (out / "latency.json").write_text(json.dumps(data, indent=2))
        log(f"wrote {out / 'latency.md'} and {out / 'latency.json'}")
    return data
