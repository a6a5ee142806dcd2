"""How stable is the tuner's choice? N repeats of its measurement (16 shipped dev prompts, 48 tokens, rotating order),
each scored by three rules: the median speedup over plain (today's), the paired median of dart+pld / pld per
prompt, and the geometric mean of per-prompt speedups."""

import math
import statistics
import sys

from dartspec.bench.suite import MethodSpec, load_prompts, run_suite
from dartspec.targets import load_target
from dartspec.tune import TUNE_PROMPTS

target = load_target("smollm2-135m")
prompts = load_prompts(str(TUNE_PROMPTS), limit=16)
new_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 48
for rep in range(int(sys.argv[1])):
    specs = [MethodSpec(d, d) for d in ("dart+pld", "pld")]
    runs = run_suite(target, specs, prompts, max_new_tokens=new_tokens)
    by = {}
    for r in runs:
        by.setdefault(r.prompt, {})[r.method] = r.new_tokens / r.seconds
    sp = {m: [p[m] / p["ar"] for p in by.values()] for m in ("dart+pld", "pld")}
    med = {m: statistics.median(v) for m, v in sp.items()}
    geo = {m: math.exp(statistics.mean(math.log(x) for x in v)) for m, v in sp.items()}
    paired = statistics.median(p["dart+pld"] / p["pld"] for p in by.values())
    print(
        f"rep {rep}: median dart+pld {med['dart+pld']:.3f} pld {med['pld']:.3f} | geo {geo['dart+pld']:.3f} "
        f"{geo['pld']:.3f} | paired dart+pld/pld {paired:.3f}",
        flush=True,
    )
