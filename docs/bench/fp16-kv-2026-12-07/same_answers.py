"""Greedy answers (128 new tokens) on the first N prompts of each data set: plain decoding over an fp16 KV cache
against plain decoding over fp32, and dart+pld over fp16 against plain over fp16.

    .venv/bin/python docs/bench/fp16-kv-2026-12-07/same_answers.py 20 mtbench humaneval
    .venv/bin/python docs/bench/fp16-kv-2026-12-07/same_answers.py 20 docs/bench/fp16-kv-2026-12-07/long20.jsonl
"""

import sys

from dartspec.bench.suite import load_prompts
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target

t16 = load_target("smollm2-135m", kv_cache="fp16")
t32 = load_target("smollm2-135m", kv_cache="fp32")
plain = build_generator(t16, GeneratorSpec(drafter="none"))
spec = build_generator(t16, GeneratorSpec(drafter="dart+pld"))
plain32 = build_generator(t32, GeneratorSpec(drafter="none"))
same = diff32 = n = 0
for ds in sys.argv[2:]:
    for _, m in load_prompts(ds, limit=int(sys.argv[1])):
        msgs = [{"role": "user", "content": m}]
        a = plain.generate(msgs, max_new_tokens=128).token_ids
        b = spec.generate(msgs, max_new_tokens=128).token_ids
        c = plain32.generate(msgs, max_new_tokens=128).token_ids
        n += 1
        same += a == b
        diff32 += a != c
print(f"{n} prompts: dart+pld == plain on fp16 cache: {same}; fp16 plain != fp32 plain: {diff32}")
