"""A/B: the drafter's C-kernel weights in 8-bit groups (shipped) vs 4-bit groups, interleaved."""

import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from dartspec import exact
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target


def quantize4(weight):
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    out, k = w.shape
    g = w.reshape(out, k // 32, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    q = torch.where(d > 0, (g - m) / torch.where(d > 0, d, 1), 0).round().clamp(0, 15).to(torch.uint8)
    nib = q[..., :16] | (q[..., 16:] << 4)
    return exact.ExactWeight(4, nib.contiguous(), d[..., 0].contiguous(), m[..., 0].contiguous(), out, k)


t = load_target("smollm2-135m")
spec = GeneratorSpec(drafter=sys.argv[1] if len(sys.argv) > 1 else "auto")
gens = {"ar": build_generator(t, GeneratorSpec(drafter="none")), "q8": build_generator(t, spec)}
with mock.patch.object(exact, "quantize8", quantize4):
    gens["q4"] = build_generator(t, spec)
n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
dev = Path("docs/bench/cpu-default-dart-pld-2026-11-26/dev80.jsonl").read_text().splitlines()
prompts = [json.loads(line)["prompt"] for line in dev][:n]


def msgs(p):
    return [{"role": "user", "content": p}]


for g in gens.values():
    g.generate(t.encode_chat(msgs(prompts[0])), max_new_tokens=16)
res = {k: [] for k in gens}
order = list(gens)
for i, p in enumerate(prompts):
    ids = t.encode_chat(msgs(p))
    outs = {}
    for k in order[i % 3 :] + order[: i % 3]:
        s = time.perf_counter()
        r = gens[k].generate(ids, max_new_tokens=128)
        el = time.perf_counter() - s
        outs[k] = r.token_ids
        res[k].append(
            (
                el,
                len(r.token_ids),
                r.stats.tau if hasattr(r.stats, "tau") else r.stats.new_tokens / max(1, r.stats.target_forwards),
            )
        )
    assert outs["q4"] == outs["ar"] == outs["q8"], i
for k in ("q8", "q4"):
    sp = [res["ar"][i][0] / res[k][i][0] for i in range(n)]
    rel = [res["q8"][i][0] / res[k][i][0] for i in range(n)]
    print(
        k,
        f"speedup vs ar median {statistics.median(sp):.3f}",
        f"vs q8 {statistics.median(rel):.3f}",
        "tau pooled %.3f" % (sum(r[1] for r in res[k]) / sum(r[1] / r[2] for r in res[k])),
    )
