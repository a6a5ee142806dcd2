"""``dartspec demo`` (what ``make demo`` runs): speculative vs plain decoding on three real prompts.

A small instance of :mod:`dartspec.bench.suite`: every method runs back to back on each prompt
(rotating order, after a warm-up), greedy outputs are compared token for token with plain decoding,
and the table shows tau, tokens/s and speedup per method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dartspec.bench.report import markdown, summarize
from dartspec.bench.suite import parse_methods, run_suite


def demo_prompts() -> list[tuple[str, str]]:
    """A writing, an extraction and a coding prompt from MT-Bench and HumanEval."""
    from dartspec.data.sources import load_humaneval, load_mtbench

    mt = {q["question_id"]: q for q in load_mtbench()}
    he = load_humaneval()[0]
    return [
        ("mtbench/81 writing", mt[81]["turns"][0]),
        ("mtbench/131 extraction", mt[131]["turns"][0]),
        (f"humaneval/{he['task_id'].split('/')[-1]}", "Complete this Python function:\n\n" + he["prompt"]),
    ]


def demo_peers(target: Any) -> list[str]:
    """Rows beside the target's own: plain decoding in exact fp32 (transformers) when the target runs another
    format, and llama.cpp on the same weight precision when llama-cpp-python is installed."""
    import importlib.util

    from dartspec.targets import describe

    peers = [] if describe(target).startswith("hf/") else ["ar:runtime=hf,quant=none"]
    if importlib.util.find_spec("llama_cpp") is not None and target.name == "smollm2-135m":
        # The exact formats keep the GGUF's own integers: their peer is llama.cpp on that file; fp16 / fp32
        # compare with F16.
        same_weights = getattr(target, "quant", "none") in ("exact", "exact-a16")
        peers.append("llamacpp-ar" if same_weights else "llamacpp-ar:gguf=f16")
    return peers


def run_demo(target: Any, methods: list[str], max_new_tokens: int, log: Callable[[str], None]) -> str:
    """Run ``methods`` (``none`` is plain decoding) on the demo prompts; returns a Markdown report."""
    names = ["ar" if m == "none" else m for m in methods]
    specs = parse_methods(",".join(names))  # every row at its default tree size, as `generate` would run it
    log(f"running {', '.join(s.label for s in specs)} on {len(demo_prompts())} prompts ({max_new_tokens} new tokens)")
    runs = run_suite(target, specs, demo_prompts(), max_new_tokens=max_new_tokens)
    rows = summarize(runs)
    from dartspec.targets import describe

    title = f"dartspec demo: {target.name} ({describe(target)}), greedy, {max_new_tokens} new tokens, {target.device}"
    lines = [markdown(rows, title), ""]
    for r in rows:
        if r["method"] != "ar":
            same = "identical to plain decoding" if not r["mismatches"] else "OUTPUT DIFFERS FROM PLAIN DECODING"
            if not r["exact"]:
                same = f"other numerics: {r['differs']}/{r['prompts']} answers differ from plain decoding's"
            lines.append(f"{r['method']}: tau {r['tau']:.2f}, median speedup {r['speedup']:.2f}x, {same}")
    return "\n".join(lines)
