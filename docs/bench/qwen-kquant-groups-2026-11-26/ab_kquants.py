"""Qwen2.5-Coder-0.5B plain decoding, interleaved in one process: the K-quant down projections as fp16 panels
(before), Q4_K only as integer groups, Q4_K and Q6_K as integer groups read from the GGUF (dartspec.kquants)."""

import statistics
import time
from unittest import mock

import dartspec.weight_cache as wc
from dartspec import kquants
from dartspec.bench.suite import encode_prompts, load_prompts
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target

with (
    mock.patch.object(kquants, "source_gguf", lambda folder: None),
    mock.patch.object(wc.PackedCache, "for_model", lambda *a, **k: None),
):
    old = load_target("qwen2.5-coder-0.5b")
real = kquants.file_groups
with (
    mock.patch.object(kquants, "file_groups", lambda *a: {n: g for n, g in real(*a).items() if g.kind == 4}),
    mock.patch.object(wc.PackedCache, "for_model", lambda *a, **k: None),
):
    q4 = load_target("qwen2.5-coder-0.5b")
new = load_target("qwen2.5-coder-0.5b")
for t in (old, q4, new):
    print(t.weight_format, t.weight_bytes / 1e6)
gens = {
    "fp16-panels": build_generator(old, GeneratorSpec()),
    "q4k-only": build_generator(q4, GeneratorSpec()),
    "k-groups": build_generator(new, GeneratorSpec()),
}
res = {k: [] for k in gens}
for ds in ("humaneval", "mtbench"):
    prompts = encode_prompts(new, load_prompts(ds, limit=8))
    for g in gens.values():
        g.generate(prompts[0][1], max_new_tokens=8)
    for i, (_, ids) in enumerate(prompts):
        outs = {}
        for k in list(gens)[i % 3 :] + list(gens)[: i % 3]:
            s = time.perf_counter()
            r = gens[k].generate(ids, max_new_tokens=128)
            el = time.perf_counter() - s
            outs[k] = r.token_ids
            res[k].append(len(r.token_ids) / el)
        same = outs["fp16-panels"] == outs["k-groups"] == outs["q4k-only"]
        print(ds, i, "same" if same else "DIFFER", " ".join(f"{k} {res[k][-1]:.1f}" for k in gens), flush=True)
    n = len(prompts)
    for k in ("q4k-only", "k-groups"):
        ratio = [res[k][-n + j] / res["fp16-panels"][-n + j] for j in range(n)]
        print(
            ds,
            k,
            f"median tok/s ratio over fp16 panels {statistics.median(ratio):.3f}",
            f"min {min(ratio):.3f} max {max(ratio):.3f}",
        )
