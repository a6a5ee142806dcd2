"""``dartspec demo`` (what ``make demo`` runs): speculative vs plain decoding on a few real prompts.

For each prompt, every method runs back to back (rotating order, after a warm-up) and greedy outputs
are compared token for token with plain decoding. Prints tau, tokens/s and speedup per method.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from dartspec.drafters import make_drafter
from dartspec.engine import Generator
from dartspec.target import Target


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


def run_demo(target: Target, methods: list[str], max_new_tokens: int, log: Callable[[str], None]) -> str:
    # Trees of a few nodes: on a 2-core CPU verifying 4 nodes costs ~1.3x one token, 16 nodes ~2.3x.
    gens = {
        m: Generator(target, make_drafter(m, target), tree_size=6, max_depth=8)
        for m in ["none", *[m for m in methods if m != "none"]]
    }
    rows = []
    for label, prompt in demo_prompts():
        ids = target.encode_chat([{"role": "user", "content": prompt}])
        gens["none"].generate(ids, max_new_tokens=8)  # warm-up
        results = {}
        order = list(gens)
        for round_ in range(2):
            for name in order if round_ % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                res = gens[name].generate(ids, max_new_tokens=max_new_tokens)
                wall = time.perf_counter() - start
                if name not in results or wall < results[name][0]:
                    results[name] = (wall, res)
        base_wall, base = results["none"]
        for name, (wall, res) in results.items():
            same = res.token_ids == base.token_ids
            rows.append(
                (
                    label,
                    name,
                    res.stats.tau,
                    len(res.token_ids) / wall,
                    base_wall / wall * (len(res.token_ids) / max(len(base.token_ids), 1)),
                    same,
                )
            )
            log(
                f"{label:24s} {name:6s} tau {res.stats.tau:5.2f}  {len(res.token_ids) / wall:6.1f} tok/s  "
                f"identical to plain: {'yes' if same else 'NO'}"
            )
    lines = [
        f"dartspec demo: {target.name}, greedy, {max_new_tokens} new tokens, {target.device}",
        "",
        "| prompt | method | tau | tok/s | speedup vs plain | identical |",
        "|---|---|---|---|---|---|",
    ]
    for label, name, tau, tps, speedup, same in rows:
        lines.append(f"| {label} | {name} | {tau:.2f} | {tps:.1f} | {speedup:.2f}x | {'yes' if same else 'NO'} |")
    for name in gens:
        if name != "none":
            med = statistics.median(r[4] for r in rows if r[1] == name)
            lines.append(f"\nmedian speedup of {name} over plain decoding: {med:.2f}x")
    return "\n".join(lines)
