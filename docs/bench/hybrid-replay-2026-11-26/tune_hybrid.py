"""Replay dart+pld variants at fixed sizes on dev answers: lookup matches, span length cap, DART share."""
import itertools
import json
import sys

import numpy as np

from dartspec.bench.replay import LookupReplay, Replay, ReplayEntry, replay_samples
from dartspec.bench.suite import encode_prompts, load_prompts
from dartspec.drafters.hybrid import HybridDrafter, hybrid_tree
from dartspec.drafters.pld import PromptLookupDrafter
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target
from dartspec.train.evaluate import greedy_samples

dataset, limit, sizes = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
target = load_target("smollm2-135m")
gen = build_generator(target, GeneratorSpec(drafter="dart+pld", tree_size=16))
hybrid = gen.drafter


class Capped(PromptLookupDrafter):
    def __init__(self, matches, span):
        super().__init__(max_matches=matches)
        self.span = span

    def continuations(self, tokens, length):
        return super().continuations(tokens, min(length, self.span))


class Variant(LookupReplay):
    def __init__(self, matches, span, draft):
        super().__init__(hybrid)
        self.lookup = Capped(matches, span)
        self.draft_nodes = draft


if dataset.startswith("data/"):
    from dartspec.train.cli import samples_from

    prompts = [s.tokens[: s.prompt_len].tolist() for s in samples_from(dataset)][:limit]
else:
    prompts = [p for _, p in encode_prompts(target, load_prompts(dataset, limit=limit))]
samples = greedy_samples(target, prompts, 128)
entries = []
for size in sizes:
    entries.append(ReplayEntry(f"dart:size={size}", hybrid.drafter, size, 8, "shipped"))
    for matches, span, draft in itertools.product((1, 2, 3), (4, 8), (None, size // 2)):
        entries.append(ReplayEntry(f"size={size},m={matches},span={span},draft={draft}", Variant(matches, span, draft), size, 8, "shipped"))
reps = replay_samples(target, entries, samples, 128)
for r in reps:
    print(f"{r.label:40s} median {r.tau:.3f} pooled {r.pooled_tau:.3f} nodes {np.mean(r.nodes):.1f}", flush=True)
