"""The report of a ``dartspec bench`` run: per-method summary (median speedup over plain decoding on the same
prompt, its IQR, tau, acceptance per depth, time shares, mismatches), a Markdown table, plots, files."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dartspec.bench.suite import Run


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


#: Above this share of a row's time in the prompt's prefill, the table adds its decoding-only speedup: on long prompts
#: the prefill (the same for every method) hides what the method changes (2,000-token prompts on SmolLM2: 4 s of a
#: 4.5-5.5 s generation of 128 tokens).
PREFILL_SHARE_SHOWN = 0.25


def _decode_seconds_per_token(run: Run) -> float | None:
    """Seconds a new token after the prefill; None where the run has no prefill time (peers) or no tokens."""
    if "prefill" not in run.times or not run.new_tokens:
        return None
    return (run.seconds - run.times["prefill"]) / run.new_tokens


def summarize(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per method: median tau and tokens/s, speedup over plain decoding (median, IQR), the same after the prefill
    (``decode_speedup``, the prefill left out of both), shares, mismatches."""
    by_prompt: dict[str, dict[str, Run]] = {}
    for r in runs:
        by_prompt.setdefault(r.prompt, {})[r.method] = r
    methods = list(dict.fromkeys(r.method for r in runs))
    rows = []
    for m in methods:
        mine = [r for r in runs if r.method == m]
        speedups, decode = [], []
        for r in mine:
            ar = by_prompt[r.prompt].get("ar")
            if ar and r.seconds > 0 and ar.new_tokens and r.new_tokens:
                speedups.append((r.new_tokens / r.seconds) / (ar.new_tokens / ar.seconds))
            mine_s, ar_s = _decode_seconds_per_token(r), ar and _decode_seconds_per_token(ar)
            if mine_s and ar_s and mine_s > 0:
                decode.append(ar_s / mine_s)
        q1, med, q3 = _quartiles(speedups) if speedups else (float("nan"),) * 3
        depth = max((len(r.accept_per_depth) for r in mine), default=0)
        accept = [
            statistics.mean(r.accept_per_depth[d] for r in mine if len(r.accept_per_depth) > d) for d in range(depth)
        ]
        total = {k: sum(r.times.get(k, 0.0) for r in mine) for k in ("draft", "tree", "verify")}
        seconds = sum(r.seconds for r in mine)
        prefill = sum(r.times.get("prefill", 0.0) for r in mine)
        taus = [r.tau for r in mine if r.tau == r.tau]
        rows.append(
            {
                "method": m,
                "prompts": len(mine),
                "tau": statistics.median(taus) if taus else float("nan"),
                "tokens_per_s": statistics.median(r.new_tokens / r.seconds for r in mine if r.seconds > 0),
                "speedup": med,
                "speedup_iqr": [q1, q3],
                "decode_speedup": statistics.median(decode) if decode else None,
                "prefill_share": prefill / seconds if seconds else 0.0,
                "accept_per_depth": accept,
                "shares": {k: v / seconds if seconds else 0.0 for k, v in total.items()},
                "mismatches": sum(1 for r in mine if r.matches_ar is False and r.exact),
                "differs": sum(1 for r in mine if r.matches_ar is False and not r.exact),
                "exact": all(r.exact for r in mine),
            }
        )
    return rows


def markdown(rows: Sequence[dict[str, Any]], title: str) -> str:
    lines = [
        f"### {title}",
        "",
        "| method | tau | tok/s | speedup vs ar (IQR) | accept d1..d4 | draft / tree / verify | mismatches |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["accept_per_depth"][:4]) or "-"
        sh = r["shares"]
        shares = f"{sh['draft']:.0%} / {sh['tree']:.0%} / {sh['verify']:.0%}" if sh["verify"] else "-"
        tau = f"{r['tau']:.2f}" if r["tau"] == r["tau"] else "-"
        lo, hi = r["speedup_iqr"]
        mism = str(r["mismatches"]) if not r["mismatches"] else f"**{r['mismatches']} MISMATCH**"
        if not r.get("exact", True):
            mism = f"{r['differs']}/{r['prompts']} differ (other numerics)"
        speedup = f"{r['speedup']:.2f}x ({lo:.2f}-{hi:.2f})"
        if r.get("decode_speedup") is not None and r.get("prefill_share", 0.0) > PREFILL_SHARE_SHOWN:
            speedup += f"; after the prefill {r['decode_speedup']:.2f}x"
        lines.append(f"| {r['method']} | {tau} | {r['tokens_per_s']:.1f} | {speedup} | {acc} | {shares} | {mism} |")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], out: Path, title: str) -> list[Path]:
    """Speedup bars (with IQR) and acceptance per depth; returns the PNG paths."""
    from dartspec.plotting import pyplot

    plt = pyplot("plots (--plot)")
    paths = []
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(rows), 3.6))
    names = [r["method"] for r in rows]
    med = [r["speedup"] for r in rows]
    err = [
        [m - r["speedup_iqr"][0] for m, r in zip(med, rows, strict=True)],
        [r["speedup_iqr"][1] - m for m, r in zip(med, rows, strict=True)],
    ]
    ax.bar(names, med, yerr=err, capsize=4, color="#4c72b0")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for r in rows:
        if r["accept_per_depth"]:
            ax.plot(range(1, len(r["accept_per_depth"]) + 1), r["accept_per_depth"], marker="o", label=r["method"])
    ax.set_xlabel("draft depth")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "acceptance.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def write_results(
    runs: Sequence[Run], rows: Sequence[dict[str, Any]], meta: dict[str, Any], out: Path, *, plots: bool = True
) -> str:
    """Write results.md, results.json and (``plots``) the plots into ``out``; returns the Markdown table."""
    out.mkdir(parents=True, exist_ok=True)
    title = f"{meta['model']} · {meta['dataset']} · T={meta['temperature']} · {meta['max_new_tokens']} new tokens"
    table = markdown(rows, title)
    (out / "results.md").write_text(table + "\n")
    payload = {
        "meta": meta,
        "summary": list(rows),
        "runs": [{k: v for k, v in asdict(r).items() if k != "token_ids"} for r in runs],
    }
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=repr))  # a grammar as its repr
    if plots:
        plot(rows, out, title)
    return table
