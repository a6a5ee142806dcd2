"""Greedy token ids of plain decoding on 20 MT-Bench and 20 HumanEval prompts (128 new tokens), written to a JSON
file: run once per kernel build and compare the files (README.md here).

    .venv/bin/python docs/bench/amx-2026-12-06/fp16-kv/gen_ids.py ids.json
"""

import json
import sys

from dartspec.bench.suite import load_prompts
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target

t = load_target("smollm2-135m")
gen = build_generator(t, GeneratorSpec(drafter="none"))
out = {}
for ds in ("mtbench", "humaneval"):
    for i, (_, message) in enumerate(load_prompts(ds, limit=20)):
        out[f"{ds}/{i}"] = gen.generate([{"role": "user", "content": message}], max_new_tokens=128).token_ids
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
print(len(out), "answers")
