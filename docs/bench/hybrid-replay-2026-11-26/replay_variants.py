"""Replay `dart+pld` variants on dev answers (the numbers in BENCHMARKS.md, "Lookup spans at 16 and 32 nodes").

    python docs/bench/hybrid-replay-2026-11-26/replay_variants.py lookup data/smollm2-135m-sharegpt-dev 120 16,32
    python docs/bench/hybrid-replay-2026-11-26/replay_variants.py depth data/smollm2-135m-sharegpt-dev 120 16,32

``lookup``: matches 1-3, spans of at most 4 / 8 tokens, DART's share uncapped or half the budget; ``depth``: the
shipped lookup with spans and trees to depth 8 / 12 / 16. Tune on development answers only.
"""

import itertools
import sys

import numpy as np

from dartspec.bench.replay import LookupReplay, ReplayEntry, replay_samples
from dartspec.drafters.pld import PromptLookupDrafter
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target
from dartspec.train.cli import samples_from
from dartspec.train.evaluate import greedy_samples

grid, data, limit, sizes = sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(x) for x in sys.argv[4].split(",")]
target = load_target("smollm2-135m")
hybrid = build_generator(target, GeneratorSpec(drafter="dart+pld", tree_size=16)).drafter


class SpanCap(PromptLookupDrafter):
    """Prompt lookup whose spans stop after ``span`` tokens."""

    def __init__(self, matches: int, span: int) -> None:
        super().__init__(max_matches=matches)
        self.span = span

    def continuations(self, tokens, length):
        return super().continuations(tokens, min(length, self.span))


def variant(matches: int, span: int, draft: int | None) -> LookupReplay:
    replay = LookupReplay(hybrid)
    replay.lookup, replay.draft_nodes = SpanCap(matches, span), draft
    return replay


entries = []
for size in sizes:
    if grid == "lookup":
        entries.append(ReplayEntry(f"dart:size={size}", hybrid.drafter, size, 8, "shipped"))
        for m, span, draft in itertools.product((1, 2, 3), (4, 8), (None, size // 2)):
            label = f"size={size},m={m},span={span},draft={draft}"
            entries.append(ReplayEntry(label, variant(m, span, draft), size, 8, "shipped"))
    else:
        for depth in (8, 12, 16):
            label = f"size={size},max_depth={depth}"
            entries.append(ReplayEntry(label, variant(3, depth, None), size, depth, "shipped"))
prompts = [s.tokens[: s.prompt_len].tolist() for s in samples_from(data)][:limit]
for r in replay_samples(target, entries, greedy_samples(target, prompts, 128), 128):
    print(f"{r.label:40s} median {r.tau:.3f} pooled {r.pooled_tau:.3f} nodes {np.mean(r.nodes):.1f}", flush=True)
