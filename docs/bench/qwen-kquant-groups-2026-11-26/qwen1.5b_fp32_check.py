"""Greedy answers of the lean runtime (K-quant groups) against transformers' fp32 on a user's Q4_K_M file."""

from dartspec.bench.suite import encode_prompts, load_prompts
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target

p = "/tmp/tm/model/qwen2.5-coder-1.5b-q4_k_m.gguf"
lean, hf = load_target(p), load_target(p, runtime="hf")
for ds in ("mtbench", "humaneval"):
    for name, ids in encode_prompts(lean, load_prompts(ds, limit=2)):
        a = build_generator(lean, GeneratorSpec(drafter="none")).generate(ids, max_new_tokens=48).token_ids
        b = build_generator(hf, GeneratorSpec(drafter="none")).generate(ids, max_new_tokens=48).token_ids
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        print(ds, name, "identical to hf fp32" if a == b else f"differs at token {first}", flush=True)
