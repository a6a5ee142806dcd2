"""Teacher-forced accuracy (dartspec.train.evaluate, `bench accuracy`): a hit is what verification accepts."""

from __future__ import annotations

import numpy as np
import torch
from conftest import VOCAB
from test_dart import model_for

from dartspec.drafters import NoDrafter
from dartspec.drafters.dart_model import DraftKV
from dartspec.engine import Generator
from dartspec.target import Target
from dartspec.train.dart_loss import distill
from dartspec.train.evaluate import depth_accuracies, depth_accuracy, greedy_samples, model_objective


def test_a_hit_needs_the_targets_top1_over_its_whole_vocabulary() -> None:
    d2t = torch.tensor([0, 2, 3])
    target = torch.tensor([[0.0, 9.0, 5.0, 1.0], [0.0, 1.0, 5.0, 1.0]])  # row 0's best token (1) is not draftable
    draft = torch.tensor([[0.0, 4.0, 1.0], [0.0, 4.0, 1.0]])  # both rows pick draft id 1 = target id 2
    _, hits = distill(draft, target, d2t, "kl")
    assert hits.tolist() == [False, True]


def test_depth_accuracy_counts_what_incremental_drafting_would_propose(llama_target: Target) -> None:
    target = llama_target
    depth = 4
    model = model_for(target, depth=depth).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        model.d2t.copy_(torch.arange(64) * 3 % VOCAB)  # some target ids are not draftable
    ids = np.random.default_rng(3).integers(2, VOCAB, size=26)
    prompt_len = 9
    got = depth_accuracy(target, [(ids, prompt_len)], model_objective(model, anchors=1000), depth=depth)

    out = target.score_sequence(ids.tolist())
    feats = out.features.float()
    embeds = target.model.get_input_embeddings()(torch.tensor(ids[1:])).detach().float()
    n = len(ids)
    hits, scored = np.zeros(depth), np.zeros(depth)
    for a in range(prompt_len - 2, n - 1):  # the drafter's root at position a; depth t guesses token a + t + 1
        with torch.no_grad():
            logp = model.step(feats[: a + 1], embeds[: a + 1], 0, DraftKV(), depth=depth)
        for t in range(1, depth + 1):
            if a + t > n - 1 or (t > 1 and a > n - 3):
                continue
            scored[t - 1] += 1
            hits[t - 1] += int(model.d2t[logp[t - 1].argmax()] == out.logits[a + t].argmax())
    assert got.scored == scored.astype(int).tolist()
    np.testing.assert_allclose(got.top1, hits / scored)
    assert 0 < hits.sum() < scored.sum()  # neither trivially all-hit nor all-miss
    assert got.chain_tau_est == 1 + np.cumprod(hits / scored).sum()


def test_drafters_scored_on_one_target_pass_get_their_separate_figures(llama_target: Target) -> None:
    """`train promote` scores two drafters on one target pass per sample: each must get exactly what it gets
    alone (its own anchor draws, the target's outputs untouched by the other's objective)."""
    target = llama_target
    rng = np.random.default_rng(5)
    samples = [(rng.integers(2, VOCAB, size=n), p) for n, p in ((30, 8), (22, 5), (3, 1), (40, 12))]
    models = []
    for seed, depth in ((0, 4), (1, 3)):
        torch.manual_seed(seed)
        model = model_for(target, depth=depth).float().eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        models.append(model)
    together = depth_accuracies(
        target, samples, [model_objective(m, anchors=6) for m in models], depths=[4, 3], batch=2
    )
    alone = [
        depth_accuracy(target, samples, model_objective(m, anchors=6), depth=d, batch=2)
        for m, d in zip(models, [4, 3], strict=True)
    ]
    assert together == alone
    assert together[0].loss != together[1].loss and together[0].sequences == 3  # two drafters; one sample too short


def test_greedy_samples_are_plain_decoding(llama_target: Target) -> None:
    target = llama_target
    prompts = [[5, 6, 7], [9, 10]]
    got = greedy_samples(target, prompts, max_new_tokens=6)
    plain = Generator(target, NoDrafter())
    for (tokens, prompt_len), ids in zip(got, prompts, strict=True):
        assert prompt_len == len(ids)
        assert tokens.tolist() == ids + plain.generate(ids, max_new_tokens=6).token_ids
