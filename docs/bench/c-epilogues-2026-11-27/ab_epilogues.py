"""The C epilogues against the code before them, interleaved in one process.

New: the target's final norm at the end of the fused stack's C call, its head and each row's argmax in one C call, the
DART drafter's input norms, final norm, head and log-softmax in C, every layer's KV slots filled in one pass. Old (the
same code with the earlier steps patched back in): torch's final norm after the stack, the verifier's torch argmax, the
drafter's norms and log-softmax as torch operations, the slots filled layer by layer.

Usage: python ab_epilogues.py FIRST LAST (dev80.jsonl prompts FIRST..LAST-1). Each prompt is decoded greedily (128 new
tokens) by plain decoding and by the CPU default (``dart+pld``, 4 nodes, DART's share 3) on both, in an order rotating
by prompt; prints medians and IQRs of the per-prompt speed ratios, median tau, and how many prompts' outputs differ.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dartspec import exact
from dartspec.drafters.dart_fast import FastDraftNet
from dartspec.lean import LeanTarget
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target

DEV80 = Path(__file__).resolve().parent.parent / "cpu-default-dart-pld-2026-11-26" / "dev80.jsonl"


def run_blocks_before(self: LeanTarget, stack, x, rot_pairs, caches, sizes, masks, features, rot_local=None, wm=()):
    """``LeanTarget._run_blocks`` before: slots filled per layer, torch's final norm after the stack's call."""
    slots = self.sequence_slots(caches, sizes, masks, wm)
    feats = x.new_empty((x.shape[0], len(self.feature_layers) * x.shape[1])) if features else None
    layers = np.asarray(self.feature_layers, dtype=np.int64) if features else None
    for i in range(len(self.layers)):
        row = slots.kv[i]
        for s, (cache, q) in enumerate(zip(caches, sizes, strict=True)):
            keys, values, _ = cache.layers[i].extend(q, self._no_kv, self._no_kv)
            row["k"][s], row["v"][s], row["cap"][s] = keys.data_ptr(), values.data_ptr(), keys.shape[2]
        slots.layer = i
    stack(x, rot_pairs, slots, self.share_prefix_attention, layers, feats, rot_local)
    x.copy_(F.rms_norm(x, (x.shape[-1],), self._norm, self.eps))
    return feats


def drafter_before(net: FastDraftNet) -> None:
    """The drafter's norms, head and log-softmax as torch operations (as before)."""
    H, eps = net.cfg.hidden_size, net.cfg.rms_norm_eps

    def inputs(first: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(first, (H,), net.norm_feat, eps), F.rms_norm(embeds.float(), (H,), net.norm_embed, eps)
        return torch.cat(normed, -1)

    def logprobs(resid: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(exact.linear_a16(F.rms_norm(resid, (H,), net.norm, eps), net.head), dim=-1)

    net.inputs, net.logprobs = inputs, logprobs


def main(first: int, last: int) -> None:
    prompts = [json.loads(line)["prompt"] for line in DEV80.read_text().splitlines()][first:last]
    new, old = load_target("smollm2-135m"), load_target("smollm2-135m")
    old._c_head = None  # the verifier takes torch's argmax
    old._stack = exact.BlockStack([layer.block for layer in old.layers])  # no final norm in C
    old._run_blocks = types.MethodType(run_blocks_before, old)
    hybrid = GeneratorSpec(drafter="dart+pld", tree_size=4, draft_nodes=3)
    gens = {
        "ar_old": build_generator(old, GeneratorSpec()),
        "ar_new": build_generator(new, GeneratorSpec()),
        "def_old": build_generator(old, hybrid),
        "def_new": build_generator(new, hybrid),
    }
    drafter_before(gens["def_old"].drafter.drafter._net)
    for gen in gens.values():  # warm-up
        gen.generate(prompts[0], chat=True, max_new_tokens=8)
    speed: dict[str, list[float]] = {k: [] for k in gens}
    taus: dict[str, list[float]] = {k: [] for k in gens}
    outputs: list[set[tuple[int, ...]]] = []
    names = list(gens)
    for i, prompt in enumerate(prompts):
        seen = set()
        for name in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            result = gens[name].generate(prompt, chat=True, max_new_tokens=128)
            speed[name].append(len(result.token_ids) / (time.perf_counter() - start))
            taus[name].append(result.stats.tau)
            seen.add(tuple(result.token_ids))
        outputs.append(seen)
    for a, b in (("ar_new", "ar_old"), ("def_new", "def_old"), ("def_old", "ar_old"), ("def_new", "ar_new")):
        ratio = np.array(speed[a]) / np.array(speed[b])
        q1, q3 = np.percentile(ratio, [25, 75])
        print(f"{a} / {b}: median {np.median(ratio):.3f}x IQR {q1:.3f}-{q3:.3f}")
    for name in gens:
        print(f"{name}: median {np.median(speed[name]):.1f} tok/s, tau {np.median(taus[name]):.3f}")
    print("prompts whose four outputs differ:", sum(len(s) > 1 for s in outputs))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
