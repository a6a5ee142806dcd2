"""A pruned LM head, checked before it was built (2026-12-06, README.md here): SmolLM2's head requantized to 4-bit
groups, the rigorous bound on each logit's error (sum over groups of |x|_1 times the group's largest weight error;
Cauchy-Schwarz beside it), and how many of the 49,152 tokens it leaves as candidates for the argmax.

    .venv/bin/python docs/bench/amx-2026-12-06/head_bound.py
"""

import json
from pathlib import Path

import numpy as np
import torch

from dartspec.drafters import make_drafter
from dartspec.engine import Generator
from dartspec.targets import load_target

DEV = Path("docs/bench/cpu-default-dart-pld-2026-11-26/dev80.jsonl")

t = load_target("smollm2-135m")
W = t._head_weight.float().numpy()
V, K = W.shape
G = K // 32
Wg = W.reshape(V, G, 32)
lo, hi = Wg.min(-1, keepdims=True), Wg.max(-1, keepdims=True)
d = (hi - lo) / 15.0
d[d == 0] = 1e-12
Wt = np.clip(np.round((Wg - lo) / d), 0, 15) * d + lo
E = np.abs(Wg - Wt).max(-1)  # each (token, group)'s largest weight error
Wt = Wt.reshape(V, K)

# the hidden rows the head sees while SmolLM2 answers 8 development prompts (64 tokens each)
captured: list[torch.Tensor] = []
project = t._project


def spy(hidden: torch.Tensor):
    captured.append(hidden.detach().clone())
    return project(hidden)


t._project = spy
gen = Generator(t, make_drafter("none", t))
for line in DEV.read_text().splitlines()[:8]:
    list(gen.stream([{"role": "user", "content": json.loads(line)["prompt"]}], max_new_tokens=64))
X = torch.cat([c.reshape(-1, K) for c in captured]).float().numpy()
print("rows", X.shape)

Y, Yt = X @ W.T, X @ Wt.T
B = np.abs(X.reshape(-1, G, 32)).sum(-1) @ E.T  # |y - yt| <= sum_g |x_g|_1 max|w_g - wt_g|
err = np.abs(Y - Yt)
print("bound holds", bool((err <= B + 1e-4).all()), "mean error", err.mean(), "mean bound", B.mean())
cand = ((Yt + B) >= (Yt - B).max(1, keepdims=True)).sum(1)
print("candidates: median", np.median(cand), "p90", np.percentile(cand, 90), "max", cand.max())
B2 = np.linalg.norm(X, axis=1, keepdims=True) * np.linalg.norm(W - Wt, axis=1)[None]  # Cauchy-Schwarz
cand2 = ((Yt + B2) >= (Yt - B2).max(1, keepdims=True)).sum(1)
print("Cauchy-Schwarz candidates: median", np.median(cand2), "p90", np.percentile(cand2, 90), "max", cand2.max())
top2 = np.sort(Y, 1)[:, -2:]
print("median top-2 gap", np.median(top2[:, 1] - top2[:, 0]), "median largest bound", np.median(B.max(1)))
