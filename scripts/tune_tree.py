"""Tune DART's beam-search settings (dartspec.search.BeamParams) on replayed decodes (dartspec/bench/replay.py).

The target answers the first 2N prompts of a regenerated data folder (default: the dev split, ShareGPT 14000-14999;
never an evaluation set) greedily; the shipped drafter's rows come from one teacher-forced pass per answer; every
setting of the grid is replayed on the first N answers (the tuning half), and the best few and the published
defaults again on the other N (the held-out half), so a setting that only fits the tuning answers shows.

    .venv/bin/python scripts/tune_tree.py --limit 40 --sizes 16 --out docs/bench/tree-tuning
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

from tqdm import tqdm

from dartspec.bench.replay import Replay, anchor_rows, replay_answer
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.search import BeamParams, BeamTree
from dartspec.targets import load_target
from dartspec.train.cli import samples_from
from dartspec.train.evaluate import greedy_samples

GRID = {
    "ngram_weight": [0.0, 0.25, 0.5, 0.75, 1.0],
    "logit_decay": [0.8, 0.9, 1.0],
    "level_decay": [0.4, 0.7, 1.0],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="data/smollm2-135m-sharegpt-dev")
    ap.add_argument("--limit", type=int, default=40, help="answers in each half")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--sizes", default="16", help="comma-separated tree sizes")
    ap.add_argument("--top", type=int, default=3, help="settings per size checked on the held-out half")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    target = load_target(args.model)
    sizes = [int(s) for s in args.sizes.split(",")]
    gen = build_generator(target, GeneratorSpec(drafter="dart", tree_size=max(sizes)))
    drafter = gen.drafter
    base = drafter.tree_builder
    assert isinstance(base, BeamTree)
    prompts = [s.tokens[: s.prompt_len].tolist() for s in samples_from(args.data)][: 2 * args.limit]
    t0 = time.perf_counter()
    samples = greedy_samples(
        target, prompts, args.max_new_tokens, lambda items, n: tqdm(items, total=n, desc="answers")
    )
    target.set_feature_layers(drafter.model.cfg.feature_layers)
    rows = [anchor_rows(drafter.model, target, t.tolist(), p) for t, p in tqdm(samples, desc="rows")]
    print(f"{len(samples)} answers and their rows in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    halves = {"tune": range(0, args.limit), "held-out": range(args.limit, len(samples))}

    def replay(params: BeamParams, size: int, half: str) -> Replay:
        way = SimpleNamespace(
            tree_builder=BeamTree(params, ngram=base.ngram, eos_ids=base.eos.tolist()), d2t=drafter.d2t
        )
        got = Replay(f"{size}")
        for i in halves[half]:
            tokens, prompt_len = samples[i]
            replay_answer(rows[i], tokens.tolist(), prompt_len, way, size, gen.max_depth, args.max_new_tokens, got)
        return got

    results = []
    for size in sizes:
        scored = []
        for values in tqdm(list(itertools.product(*GRID.values())), desc=f"grid, size {size}"):
            params = replace(BeamParams(), **dict(zip(GRID, values, strict=True)))
            scored.append((replay(params, size, "tune").pooled_tau, params))
        scored.sort(key=lambda x: -x[0])
        default = BeamParams()
        check = [default] + [p for _, p in scored[: args.top] if p != default]
        for params in check:
            tune = next(t for t, p in scored if p == params)
            held = replay(params, size, "held-out")
            row = {
                "size": size,
                **{k: getattr(params, k) for k in GRID},
                "tune_tau": round(tune, 4),
                "held_out_tau": round(held.pooled_tau, 4),
                "held_out_median_tau": round(held.tau, 4),
                "default": params == default,
            }
            results.append(row)
            print(json.dumps(row))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"data": args.data, "answers_per_half": args.limit, "max_new_tokens": args.max_new_tokens}
        meta["grid"], meta["defaults"] = GRID, asdict(BeamParams())
        (out / "tune_tree.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
