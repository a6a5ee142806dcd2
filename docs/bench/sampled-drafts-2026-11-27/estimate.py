"""How often a depth-1 draft is kept under sampling: matching the target's own sample against the drafter's top-k
(what a deterministic tree gets) vs testing tokens drawn from the drafter by rejection (one draw, and two without
replacement), on SmolLM2's development prompts.

    python docs/bench/sampled-drafts-2026-11-27/estimate.py TEMPERATURE PROMPTS

Decodes each prompt (96 tokens, seeded) with the DART drafter at 2 nodes and, at every verify step, compares the
target's warped distribution p at the root with the drafter's first row q (at the same temperature): matching keeps
the top-k with probability p(top-k of q); rejection keeps one draw with probability sum_x min(p, q), two with
a1 + (1 - a1) * sum_x min(r, q1), where r is what the first rejection leaves and q1 is q less the first draw (here
approximated by q; the measured rows in the README use the engine itself).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from dartspec.drafters.dart import DartDrafter
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target
from dartspec.verify import Verifier, warp

DEV = "docs/bench/cpu-default-dart-pld-2026-11-26/dev80.jsonl"


def main(temperature: float, count: int) -> None:
    target = load_target("smollm2-135m")
    gen = build_generator(target, GeneratorSpec(drafter="dart", tree_size=2, tree="chain"))
    d2t = gen.drafter.d2t
    rows: list[dict[str, float]] = []
    state: dict[str, np.ndarray] = {}
    step, accept = DartDrafter._step, Verifier.accept

    def recording_step(self, *args, **kwargs):  # the drafter's first row, kept for the verify step after it
        logp = step(self, *args, **kwargs)
        state["q"] = logp[0].double().numpy().copy()
        return logp

    def measuring_accept(self, tree, logits, argmax=None):
        if "q" in state:
            p = warp(logits[0], self.params).numpy()
            lq = state.pop("q")
            order = np.argsort(-lq)
            out = {f"match top-{k}": float(p[d2t[order[:k]]].sum()) for k in (1, 2, 3, 4)}
            q = np.exp((lq - lq.max()) / temperature)
            full = np.zeros_like(p)
            full[d2t] = q / q.sum()
            first = float(np.minimum(p, full).sum())
            left = np.maximum(p - full, 0.0)
            left /= max(left.sum(), 1e-300)
            out["rejection, 1 draw"] = first
            out["rejection, 2 draws"] = first + (1 - first) * float(np.minimum(left, full).sum())
            rows.append(out)
        return accept(self, tree, logits, argmax)

    DartDrafter._step, Verifier.accept = recording_step, measuring_accept
    with open(DEV) as f:
        prompts = [json.loads(line)["prompt"] for line in f][:count]
    for seed, prompt in enumerate(prompts):
        gen.generate([{"role": "user", "content": prompt}], max_new_tokens=96, temperature=temperature, seed=seed)
    print(f"temperature {temperature}, {len(rows)} steps: depth-1 draft kept")
    for key in rows[0]:
        print(f"  {key:20s} {np.mean([r[key] for r in rows]):.3f}")


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]))
