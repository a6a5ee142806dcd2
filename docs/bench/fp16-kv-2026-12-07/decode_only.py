"""Decode-only speed from a `dartspec bench` results.json: per prompt, (seconds - prefill) per new token, each method
against `ar` on the same prompt; medians over prompts (the bench's own speedups include the prefill, which dominates
2,000-token prompts).

    python docs/bench/fp16-kv-2026-12-07/decode_only.py docs/bench/fp16-kv-2026-12-07/long20/results.json
"""

import json
import statistics
import sys
from collections import defaultdict

with open(sys.argv[1]) as f:
    runs = json.load(f)["runs"]
per = defaultdict(dict)  # prompt -> method -> (decode seconds per token, prefill seconds)
for r in runs:
    per[r["prompt"]][r["method"]] = ((r["seconds"] - r["times"]["prefill"]) / r["new_tokens"], r["times"]["prefill"])
methods = list(dict.fromkeys(r["method"] for r in runs))
print("| method | decode ms/token (median) | decode speedup vs ar (median) | prefill s (median) |")
print("|---|---|---|---|")
for m in methods:
    ms = statistics.median(p[m][0] for p in per.values()) * 1e3
    ratio = statistics.median(p["ar"][0] / p[m][0] for p in per.values())
    prefill = statistics.median(p[m][1] for p in per.values())
    print(f"| {m} | {ms:.2f} | {ratio:.2f}x | {prefill:.2f} |")
