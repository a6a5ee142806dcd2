"""Qwen2.5-Coder-1.5B: greedy answers (128 new tokens) of plain decoding over an fp16 KV cache against over fp32 on
the first N prompts of each data set (the fp16 cache's gate beside `dartspec bench fidelity`).

    .venv/bin/python docs/bench/fp16-kv-qwen15b-2026-12-07/same_answers.py 10 mtbench humaneval
"""

import sys

from dartspec.bench.suite import load_prompts
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target

MODEL = "qwen2.5-coder-1.5b"
plain16 = build_generator(load_target(MODEL, kv_cache="fp16"), GeneratorSpec(drafter="none"))
plain32 = build_generator(load_target(MODEL, kv_cache="fp32"), GeneratorSpec(drafter="none"))
differ = n = tokens = 0
for ds in sys.argv[2:]:
    for label, m in load_prompts(ds, limit=int(sys.argv[1])):
        msgs = [{"role": "user", "content": m}]
        a = plain16.generate(msgs, max_new_tokens=128).token_ids
        b = plain32.generate(msgs, max_new_tokens=128).token_ids
        n += 1
        tokens += len(b)
        if a != b:
            differ += 1
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            print(f"{label}: differs at token {first}", flush=True)
        else:
            print(f"{label}: same ({len(b)} tokens)", flush=True)
print(f"{n} prompts, {tokens} tokens: fp16-cache answers that differ from the fp32 cache's: {differ}")
