"""The CPU default by context length: with DART drafting at every length (before) and with the lookup alone past
``engine.CPU_LOOKUP_DRAFT_CONTEXT`` (now), against plain decoding (and prompt lookup alone), interleaved in one process.

Usage: python ab_context.py PER_LENGTH JOINS [pld] (e.g. ``8 0,12,18,24,40``). Prompts: development prompts (ShareGPT
14000+, ``dev80.jsonl``) alone (JOINS 0) or N of them joined, followed by a request to summarize them; 96 new tokens,
greedy. Prints per length the median context, the median per prompt of decoding speed (tokens over the time after the
prefill) over plain decoding's, its IQR and tau, and of total time (prefill included).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target

DEV80 = Path(__file__).resolve().parent.parent / "cpu-default-dart-pld-2026-11-26" / "dev80.jsonl"


def main(per: int, joins: list[int], with_pld: bool) -> None:
    texts = [json.loads(line)["prompt"] for line in DEV80.read_text().splitlines()]
    target = load_target("smollm2-135m")
    gens = {
        "ar": build_generator(target, GeneratorSpec()),
        "before": build_generator(target, GeneratorSpec(drafter="dart+pld", tree_size=4, draft_nodes=3)),
        "now": build_generator(target, GeneratorSpec(drafter="auto")),
    }
    if with_pld:
        gens["pld"] = build_generator(target, GeneratorSpec(drafter="pld", tree_size=4))
    assert gens["now"].drafter.draft_context is not None and gens["before"].drafter.draft_context is None
    for gen in gens.values():
        gen.generate(texts[0], chat=True, max_new_tokens=8)
    names = list(gens)
    for n in joins:
        decode: dict[str, list[float]] = {k: [] for k in gens}
        total: dict[str, list[float]] = {k: [] for k in gens}
        taus: dict[str, list[float]] = {k: [] for k in gens}
        contexts = []
        for i in range(per):
            if n == 0:
                prompt = texts[40 + i]
            else:
                body = "\n\n".join(texts[(i * 7) % 40 : (i * 7) % 40 + n])
                prompt = body + "\n\nSummarize the texts above in one paragraph."
            contexts.append(len(gens["ar"].encode(prompt, chat=True)))
            for name in names[i % len(names) :] + names[: i % len(names)]:
                result = gens[name].generate(prompt, chat=True, max_new_tokens=96)
                stats = result.stats
                decode[name].append(len(result.token_ids) / (stats.seconds - stats.times["prefill"]))
                total[name].append(stats.seconds)
                taus[name].append(stats.tau)
        line = []
        for name in names[1:]:
            ratio = np.array(decode[name]) / np.array(decode["ar"])
            whole = np.array(total["ar"]) / np.array(total[name])
            q1, q3 = np.percentile(ratio, [25, 75])
            line.append(
                f"{name} {np.median(ratio):.3f}x (IQR {q1:.2f}-{q3:.2f}, tau {np.median(taus[name]):.2f}; "
                f"with prefill {np.median(whole):.3f}x)"
            )
        print(f"~{int(np.median(contexts))} tokens: " + "; ".join(line))


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], "pld" in sys.argv[3:])
