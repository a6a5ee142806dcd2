"""Decoding speed of another revision against this checkout, interleaved: two worker processes (one per checkout,
each with the model and the default generator loaded) take turns on the same prompts, so both see the same minutes
of this machine.

Usage: python docs/bench/verifier-ab-2026-11-27/ab_generate.py BASE_CHECKOUT [DATASET] [LIMIT] [MAX_NEW_TOKENS]

Each worker decodes each prompt plainly (``ar``) and with the CPU default (``auto``); the report gives per side the
median tokens/s of both and the median per-prompt speedup, and whether the two sides' tokens agree.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[3]

WORKER = r"""
import json, sys, time
from dartspec.bench.suite import encode_prompts, load_prompts
from dartspec.engine import Generator
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target
target = load_target("smollm2-135m")
plain, auto = Generator(target), build_generator(target, GeneratorSpec(drafter="auto"))
prompts = encode_prompts(target, load_prompts(sys.argv[1], limit=int(sys.argv[2])))
n = int(sys.argv[3])
plain.generate(prompts[0][1], max_new_tokens=8), auto.generate(prompts[0][1], max_new_tokens=8)
print("ready", flush=True)
for line in sys.stdin:
    ids = prompts[int(line)][1]
    out = {}
    for name, gen in (("ar", plain), ("auto", auto)):
        r = gen.generate(ids, max_new_tokens=n)
        out[name] = [len(r.token_ids) / r.stats.seconds, r.token_ids]
    print(json.dumps(out), flush=True)
"""


def worker(checkout: Path, args: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd="/",
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def ask(proc: subprocess.Popen[str], i: int) -> dict:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{i}\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main() -> None:
    base = Path(sys.argv[1]).resolve()
    dataset = sys.argv[2] if len(sys.argv) > 2 else "humaneval"
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    n = sys.argv[4] if len(sys.argv) > 4 else "128"
    sides = {"base": worker(base, [dataset, str(limit), n]), "this": worker(HERE, [dataset, str(limit), n])}
    got: dict[str, list[dict]] = {"base": [], "this": []}
    for i in range(limit):
        for name in ["base", "this"] if i % 2 == 0 else ["this", "base"]:
            got[name].append(ask(sides[name], i))
    same = all(a[m][1] == b[m][1] for a, b in zip(got["base"], got["this"], strict=True) for m in ("ar", "auto"))
    for name, runs in got.items():
        ar = statistics.median(r["ar"][0] for r in runs)
        auto = statistics.median(r["auto"][0] for r in runs)
        speedup = statistics.median(r["auto"][0] / r["ar"][0] for r in runs)
        print(f"{name}: ar {ar:.1f} tok/s, auto {auto:.1f} tok/s, auto / ar {speedup:.3f}x (median per prompt)")
    ratio = statistics.median(t["auto"][0] / b["auto"][0] for b, t in zip(got["base"], got["this"], strict=True))
    ratio_ar = statistics.median(t["ar"][0] / b["ar"][0] for b, t in zip(got["base"], got["this"], strict=True))
    print(f"this / base: auto {ratio:.3f}x, ar {ratio_ar:.3f}x (median per prompt); same tokens: {same}")
    for proc in sides.values():
        proc.terminate()


if __name__ == "__main__":
    main()
