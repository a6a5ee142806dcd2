"""SmolLM2 at this session's code against c39b9ac's (imported as dartspec_old), one process, interleaved: plain
decoding and the CPU default (auto = dart+pld) on 24 dev prompts, 96 tokens; the old package made as for ab_q6k.py.
Run from the repository root."""

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, "/tmp/ab/oldpkg")
import dartspec_old.methods as om
import dartspec_old.targets as ot

import dartspec.methods as nm
import dartspec.targets as nt

torch.set_num_threads(2)
DEV = Path("docs/bench/cpu-default-dart-pld-2026-11-26/dev80.jsonl")
prompts = [json.loads(line)["prompt"] for line in DEV.read_text().splitlines()][:24]
sides = {}
for tag, t_mod, m_mod in (("old", ot, om), ("new", nt, nm)):
    target = t_mod.load_target("smollm2-135m")
    sides[tag] = {d: m_mod.build_generator(target, m_mod.GeneratorSpec(drafter=d)) for d in ("none", "auto")}
for g in (sides["old"]["none"], sides["new"]["none"]):
    g.generate([{"role": "user", "content": "hi"}], max_new_tokens=16)
res = {(tag, d): [] for tag in sides for d in ("none", "auto")}
for i, p in enumerate(prompts):
    msgs = [{"role": "user", "content": p}]
    order = ["old", "new"] if i % 2 else ["new", "old"]
    toks = {}
    for d in ("none", "auto"):
        for tag in order:
            r = sides[tag][d].generate(msgs, max_new_tokens=96)
            res[(tag, d)].append(r.stats.tokens_per_s)
            toks[(tag, d)] = r.token_ids
    assert len({tuple(v) for v in toks.values()}) == 1, "outputs differ"
for d in ("none", "auto"):
    ratio = np.array(res[("new", d)]) / np.array(res[("old", d)])
    print(
        d,
        "new/old median",
        round(float(np.median(ratio)), 3),
        "IQR",
        np.percentile(ratio, [25, 75]).round(3),
        "tok/s old",
        round(float(np.median(res[("old", d)])), 1),
        "new",
        round(float(np.median(res[("new", d)])), 1),
    )
a_old = np.array(res[("old", "auto")]) / np.array(res[("old", "none")])
a_new = np.array(res[("new", "auto")]) / np.array(res[("new", "none")])
print("auto/plain old", round(float(np.median(a_old)), 3), "new", round(float(np.median(a_new)), 3))
