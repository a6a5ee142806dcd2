"""Losslessness against independent references: transformers' own greedy ``generate`` token for token, and
the exact distribution of short sampled continuations, enumerated on a tiny model."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from conftest import VOCAB, tiny_model, tiny_tokenizer
from test_dart import model_for
from test_eagle3 import eagle_for
from test_engine import RandomDrafter

from dartspec.drafters import NoDrafter, PromptLookupDrafter
from dartspec.drafters.base import DraftBudget, DrafterBase
from dartspec.drafters.dart import DartDrafter
from dartspec.drafters.draft_model import DraftModelDrafter
from dartspec.drafters.eagle3 import Eagle3Drafter
from dartspec.drafters.hybrid import HybridDrafter
from dartspec.drafters.pld import LookupGate
from dartspec.engine import Generator
from dartspec.target import Target
from dartspec.tree import Proposal, Tree
from dartspec.tree_size import CostCurve

DRAFTERS = ("none", "pld", "pld-gated", "random", "dart", "dart+pld", "eagle3", "draft-model")


def untied_target(arch: str, dtype: torch.dtype) -> Target:
    """A tiny target with its own random LM head (the tied one makes greedy decoding repeat the last token)."""
    model = tiny_model(arch)
    torch.manual_seed(11)
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    return Target(model.to(dtype), tiny_tokenizer(), name=f"tiny-{arch}")


class NearTargetSampler(DrafterBase):
    """Draws its tree from a distribution near the target's own (the warped target mixed with a uniform), as a
    well-trained drafter would: two tokens at the root without replacement, one below the first, each parent's
    distribution attached as its proposal. So the rejection tests accept most draws, and their arithmetic decides
    the output's law (a tiny random DART network's draws are almost always rejected)."""

    name = "near-target"

    def __init__(self, target: Target) -> None:
        self.target = target

    def _near(self, tokens: Sequence[int]) -> np.ndarray:
        with torch.no_grad():
            p = reference_warp(self.target.model(torch.tensor([list(tokens)])).logits[0, -1]).numpy()
        return 0.7 * p + 0.3 / len(p)

    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        sampling = budget.sampling
        if sampling is None or budget.max_depth < 1 or budget.max_nodes < 3:
            return Tree.root_only(tokens[-1])
        ids, q = np.arange(VOCAB), self._near(tokens)
        first = int(sampling.rng.choice(ids, p=q))
        rest = q.copy()
        rest[first] = 0
        second = int(sampling.rng.choice(ids, p=rest / rest.sum()))
        draft = [tokens[-1], first, second]
        proposals = {0: Proposal(ids, q, (1, 2), (first, second))}
        parents = [-1, 0, 0]
        if budget.max_depth >= 2 and budget.max_nodes >= 4:
            below = self._near([*tokens, first])
            deeper = int(sampling.rng.choice(ids, p=below))
            draft.append(deeper)
            parents.append(1)
            proposals[1] = Proposal(ids, below, (3,), (deeper,))
        return Tree(np.array(draft), np.array(parents), proposals)


def drafter(name: str, target: Target, reference: list[int]):
    if name == "near-target":
        return NearTargetSampler(target)
    if name == "none":
        return NoDrafter()
    if name == "pld":
        return PromptLookupDrafter()
    if name == "pld-gated":  # rows cost time: the gate cuts spans, down to none, by what the answer followed so far
        return PromptLookupDrafter(gate=LookupGate(CostCurve((1, 2, 8), (1.0, 1.2, 2.5))))
    if name == "random":  # random trees, half the time with a branch along the reference for a while
        return RandomDrafter(seed=3, reference=reference)
    if name == "eagle3":
        return Eagle3Drafter(eagle_for(target).to(target.dtype), target, topk=3)
    if name == "draft-model":  # another random model with the target's tokenizer: its chains are mostly refused
        from test_draft_model import draft_target

        return DraftModelDrafter(draft_target(target.dtype), target, p_min=0.0)
    if name == "draft-model-twin":  # the target's own weights: its draws are close to the target's law
        return DraftModelDrafter(Target(target.model, tiny_tokenizer(), name="twin"), target, p_min=0.0)
    if name == "dflash":
        from test_dflash import dflash_for

        from dartspec.drafters.dflash import DFlashDrafter

        return DFlashDrafter(dflash_for(target).to(target.dtype), target, "beam")
    dart = DartDrafter(model_for(target).to(target.dtype), target, "beam")
    return HybridDrafter(dart) if name == "dart+pld" else dart


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    out = []
    for _ in range(n):
        motif = rng.integers(2, VOCAB, size=3).tolist()
        out.append(rng.integers(2, VOCAB, size=4).tolist() + motif * 2)  # a repeat gives prompt lookup matches
    return out


def reference_greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    return target.model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=1,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_greedy_output_equals_transformers_generate_in_float32(arch: str) -> None:
    target = untied_target(arch, torch.float32)
    for prompt in prompts(2):
        ref = reference_greedy(target, prompt, 24)
        for name in DRAFTERS:
            got = Generator(target, drafter(name, target, ref), tree_size=8, max_depth=4).generate(
                prompt, max_new_tokens=24
            )
            assert got.token_ids == ref, (arch, name)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_in_bfloat16_output_leaves_transformers_generate_only_at_near_ties(arch: str) -> None:
    """bf16 verification scores a tree in one forward whose matrix products round differently from one token
    at a time, so at a near-tie the argmax may differ: any divergence from transformers' bf16 ``generate`` must be
    between two tokens whose float32 logits differ by less than bf16's own error there (the sequential and the
    tree computation each carry one: four times the largest difference between the bf16 and the float32 logits
    at that position; a wrong token would typically be several logits below the best)."""
    target = untied_target(arch, torch.bfloat16)
    for prompt in prompts(2):
        ref = reference_greedy(target, prompt, 24)
        assert Generator(target, NoDrafter()).generate(prompt, max_new_tokens=24).token_ids == ref
        for name in DRAFTERS[1:]:
            got = (
                Generator(target, drafter(name, target, ref), tree_size=8, max_depth=4)
                .generate(prompt, max_new_tokens=24)
                .token_ids
            )
            if got == ref:
                continue
            i = next(j for j in range(min(len(got), len(ref))) if got[j] != ref[j])
            with torch.no_grad():
                ids = torch.tensor([prompt + ref[:i]])
                low = target.model(ids).logits[0, -1].float()
                logits = target.model.float()(ids).logits[0, -1]
            target.model.to(torch.bfloat16)
            gap = abs(float(logits[ref[i]] - logits[got[i]]))
            assert gap <= 4 * float((low - logits).abs().max()), (arch, name, i, gap)


T, TOP_P, TOP_K = 0.9, 0.9, 4


def reference_warp(logits: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the smallest most-likely set whose mass reaches p), written out
    token by token here rather than taken from dartspec."""
    probs = torch.softmax(logits.double() / T, dim=-1)
    kept = sorted(range(len(probs)), key=lambda i: -float(probs[i]))[:TOP_K]
    total = sum(float(probs[i]) for i in kept)
    out, mass = torch.zeros_like(probs), 0.0
    for i in kept:
        if mass >= TOP_P:
            break
        out[i] = probs[i] / total
        mass += float(probs[i]) / total
    return out / out.sum()


def exact_two_token_distribution(target: Target, prompt: list[int]) -> dict:
    """P(x1, x2) of the warped target, by enumerating every continuation with non-zero probability (with
    transformers' own forward, no cache)."""
    with torch.no_grad():
        first = reference_warp(target.model(torch.tensor([prompt])).logits[0, -1])
        out = {}
        for x1 in torch.nonzero(first).flatten().tolist():
            second = reference_warp(target.model(torch.tensor([[*prompt, x1]])).logits[0, -1])
            for x2 in torch.nonzero(second).flatten().tolist():
                out[(x1, x2)] = float(first[x1] * second[x2])
    return out


@pytest.mark.parametrize(
    ("name", "sampled"),
    [
        ("random", False),
        ("dart", False),
        ("dart", True),
        ("dart+pld", True),
        ("near-target", True),
        ("draft-model", False),
        ("draft-model", True),
        ("draft-model-twin", True),
    ],
)
def test_sampled_output_follows_the_exact_distribution(name: str, sampled: bool) -> None:
    """The first two tokens of three-token answers (the step after the prefill drafts one token deep; a two-token
    answer would never draft). ``sampled``: the DART drafter draws a token from its first row and the verifier tests
    it by rejection."""
    target = untied_target("llama", torch.float64)
    prompt = prompts(1)[0]
    exact = exact_two_token_distribution(target, prompt)
    top = max(exact, key=exact.get)
    gen = Generator(target, drafter(name, target, list(top)), tree_size=6, max_depth=3, sampled_drafts=sampled)
    runs = 600
    counts: dict = {}
    drafted = 0
    for seed in range(runs):
        result = gen.generate(prompt, max_new_tokens=3, temperature=T, top_p=TOP_P, top_k=TOP_K, seed=seed)
        got = tuple(result.token_ids[:2])
        counts[got] = counts.get(got, 0) + 1
        drafted += result.stats.tree_nodes > result.stats.target_forwards - 1  # more nodes than verify steps
    assert set(counts) <= set(exact)  # nothing outside the warped support
    # Pearson's chi-square over the outcomes (rare ones pooled), against a generous 99.9% bound.
    cells, pooled_p, pooled_n = [], 0.0, 0
    for key, p in exact.items():
        if p * runs >= 5:
            cells.append((counts.get(key, 0), p * runs))
        else:
            pooled_p, pooled_n = pooled_p + p, pooled_n + counts.get(key, 0)
    if pooled_p * runs >= 5:
        cells.append((pooled_n, pooled_p * runs))
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    bound = dof + 3.1 * (2 * dof) ** 0.5 + 5  # ~ the 99.9% quantile for these few degrees of freedom
    assert chi2 < bound, (chi2, dof, sorted(itertools.islice(counts.items(), 10)))
    assert drafted > runs / 2, "the answers were decoded without drafts: the test would not exercise verification"
