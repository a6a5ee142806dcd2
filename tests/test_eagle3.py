"""The EAGLE-3 baseline: network, training-time-test objective, trainer, dynamic-tree drafter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import VOCAB, tiny_target
from test_dart import model_for, random_samples, small_config

from dartspec.drafters import DraftBudget
from dartspec.drafters.dart_model import DartModel, DraftKV
from dartspec.drafters.eagle3 import Eagle3Drafter
from dartspec.drafters.eagle3_model import Eagle3Model
from dartspec.engine import Generator
from dartspec.errors import DartspecError
from dartspec.target import Target
from dartspec.train.eagle3 import Eagle3Trainer
from dartspec.train.eagle3_loss import eagle3_loss, unroll


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny_target("llama")


def eagle_for(target: Target, depth: int = 4, vocab: int = 64, seed: int = 0, noise: float = 0.0) -> Eagle3Model:
    torch.manual_seed(seed)
    model = Eagle3Model(Eagle3Model.config_for_target(target, draft_vocab_size=vocab, depth=depth))
    model = model.to(torch.float64).eval()
    if noise:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise)
    return model


def test_no_mask_slots_and_own_format(tmp_path: Path, target: Target) -> None:
    model = eagle_for(target)
    assert not any("mask" in k for k in model.state_dict())
    model.d2t.copy_(torch.arange(64) + 3)
    model.save(tmp_path, dtype=torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["format"] == "dartspec-eagle3"
    loaded = Eagle3Model.load(tmp_path, dtype=torch.float64)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=0, atol=1e-6, msg=k)
    # A checkpoint of the other kind is refused with a message naming both formats.
    with pytest.raises(DartspecError, match=r"'dartspec-dart'.*it is 'dartspec-eagle3'"):
        DartModel.load(tmp_path)
    model_for(target).save(tmp_path / "dart")
    with pytest.raises(DartspecError, match=r"'dartspec-eagle3'.*it is 'dartspec-dart'"):
        Eagle3Model.load(tmp_path / "dart")


def test_first_step_equals_dart_depth_one(tmp_path: Path, target: Target) -> None:
    """Warm start: EAGLE-3's depth-1 distribution is exactly the DART checkpoint's first row."""
    dart = model_for(target, depth=4)
    with torch.no_grad():
        for p in dart.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    dart.save(tmp_path, dtype=torch.float64)
    eagle = Eagle3Model.from_dart(tmp_path, depth=3).to(torch.float64).eval()
    ids = list(np.random.default_rng(2).integers(2, VOCAB, size=20))
    feats = target.score_sequence(ids).features[:19].clone()
    embeds = target.model.get_input_embeddings()(torch.tensor(ids[1:])).detach()
    want = dart.eval().step(feats, embeds, 0, DraftKV(), depth=1)[0]
    got, _ = eagle.context_step(feats, embeds, 0, DraftKV())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # from_dart loads in float32


def test_training_unroll_equals_incremental_drafting(target: Target) -> None:
    """Step k of row i in training is what drafting the true path from anchor i computes at depth k."""
    model = eagle_for(target, depth=4, noise=0.1)
    ids = list(np.random.default_rng(1).integers(2, VOCAB, size=30))
    feats = target.score_sequence(ids).features.clone()
    embed = target.model.get_input_embeddings()
    embeds = embed(torch.tensor(ids[1:])).detach()
    with torch.no_grad():
        pieces = unroll(model, feats, embeds, len(ids), lo=3)
    for anchor in (5, 12, 24):
        cache = DraftKV()
        model.context_step(feats[:4], embeds[:4], 0, cache)  # an earlier step's real positions
        _, h = model.context_step(feats[4 : anchor + 1], embeds[4 : anchor + 1], 4, cache)
        torch.testing.assert_close(h, pieces[0][2][anchor], rtol=0, atol=1e-9)
        tree = DraftKV()
        for k in range(2, 5):
            node = torch.tensor([ids[anchor + k]])
            mask = torch.ones(1, k - 1, dtype=torch.bool)  # the path so far, then itself
            _, out = model.tree_step(h[None], embed(node), torch.tensor([anchor + k - 1]), mask, cache, tree)
            h = out[0]
            row = anchor - pieces[k - 1][1]
            torch.testing.assert_close(h, pieces[k - 1][2][row], rtol=0, atol=1e-9)


@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_objective_scores_each_step_on_its_target_position(target: Target, kind: str) -> None:
    """The objective of one sequence equals an explicit reference over the unrolled steps: at step k, rows i from
    max(prompt - k - 1, first unrolled row) to len - 1 - k, each scored against the target's logits at i + k, the
    steps' mean losses weighted decay^(k-1); hits and counts per step likewise."""
    model = eagle_for(target, depth=4, noise=0.1)
    ids = list(np.random.default_rng(3).integers(2, VOCAB, size=30))
    out = target.score_sequence(ids)
    feats, logits = out.features.clone(), out.logits.clone()
    embeds = target.model.get_input_embeddings()(torch.tensor(ids[1:])).detach()
    prompt = 7
    with torch.no_grad():
        got = eagle3_loss(model, feats[None], embeds[None], logits[None], [30], [prompt], decay=0.8, kind=kind)
        total, hits, counts = 0.0, [], []
        for k, first, h in unroll(model, feats, embeds, 30, lo=prompt - 3):
            rows = range(max(prompt - k - 1, first), 30 - k)
            logq = torch.log_softmax(model.lm_head(model.norm(h[[i - first for i in rows]])), -1)
            full = logits[[i + k for i in rows]]
            p = torch.softmax(full[:, model.d2t], -1)
            if kind == "kl":
                loss = (p * (p.clamp_min(1e-30).log() - logq)).sum(-1)
            else:
                loss = -logq.gather(1, p.argmax(-1, keepdim=True))[:, 0]
            total += 0.8 ** (k - 1) * float(loss.mean())
            hits.append(int((model.d2t[logq.argmax(-1)] == full.argmax(-1)).sum()))
            counts.append(len(rows))
    assert got.per_depth_correct == hits and got.per_depth_count == counts
    np.testing.assert_allclose(float(got.loss), total, rtol=1e-6)


def test_dynamic_tree_budget_and_order(target: Target) -> None:
    model = eagle_for(target, depth=5, noise=0.05)
    drafter = Eagle3Drafter(model, target, topk=3)
    prompt = list(range(2, 14))
    out = target.prefill(prompt, features=True)
    committed = [*prompt, 40]  # the root: the token the prefill produced
    for nodes, depth in ((1, 4), (2, 4), (6, 4), (12, 2), (16, 5)):
        drafter.begin(prompt)
        drafter.observe(prompt, out.features)
        tree = drafter.propose(committed, DraftBudget(nodes, depth))
        assert tree.size <= nodes and tree.max_depth <= depth and int(tree.tokens[0]) == 40
        if depth > 2:  # enough candidates (3 children per expanded node, EOS nodes not expanded)
            assert tree.size == nodes
        eos = [i for i in range(1, tree.size) if int(tree.tokens[i]) in target.eos_token_ids]
        assert not any(int(tree.parents[i]) in eos for i in range(1, tree.size)), "a path continues after EOS"
        # Every non-root token is a draft-vocabulary token.
        assert set(tree.tokens[1:].tolist()) <= set(model.d2t.tolist())


def test_drafter_is_lossless_greedy_and_sampled(target: Target) -> None:
    model = eagle_for(target, depth=4, noise=0.05)
    prompt = list(range(2, 12))
    plain = Generator(target).generate(prompt, max_new_tokens=40)
    gen = Generator(target, Eagle3Drafter(model, target, topk=2), tree_size=6, max_depth=4)
    spec = gen.generate(prompt, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
    # Sampling: one uniform per committed token, so a seed gives plain sampling's tokens exactly.
    plain_s = Generator(target).generate(prompt, max_new_tokens=30, temperature=0.9, seed=3)
    spec_s = gen.generate(prompt, max_new_tokens=30, temperature=0.9, seed=3)
    assert spec_s.token_ids == plain_s.token_ids


def test_training_lowers_the_loss_at_every_step(tmp_path: Path, target: Target) -> None:
    train, dev = random_samples(16, 0), random_samples(4, 1)
    trainer = Eagle3Trainer(target, train, dev, tmp_path, small_config(max_steps=40), log=lambda m: None)
    trainer.fit(stop_after=1)
    first = trainer.evaluate()
    trainer.fit(resume=True)
    last = trainer.evaluate()
    assert last["dev_loss"] < 0.7 * first["dev_loss"], (first, last)
    assert len(last["dev_top1"]) == 4
    # The unrolled steps learn too (they see the drafter's own hidden states, not the target's).
    assert sum(last["dev_top1"][1:]) > sum(first["dev_top1"][1:])


def test_resume_continues_exactly(tmp_path: Path, target: Target) -> None:
    cfg = small_config(max_steps=6, checkpoint_every=2)
    train, dev = random_samples(8, 0), random_samples(2, 1)
    Eagle3Trainer(target, train, dev, tmp_path / "full", cfg, log=lambda m: None).fit()
    ref = [json.loads(x)["loss"] for x in (tmp_path / "full" / "train_log.jsonl").read_text().splitlines()]
    Eagle3Trainer(target, train, dev, tmp_path / "part", cfg, log=lambda m: None).fit(stop_after=2)
    Eagle3Trainer(target, train, dev, tmp_path / "part", cfg, log=lambda m: None).fit(resume=True)
    got = [json.loads(x)["loss"] for x in (tmp_path / "part" / "train_log.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)


def test_warm_start_from_dart(tmp_path: Path, target: Target) -> None:
    from dartspec.train.dart import DartTrainer

    train, dev = random_samples(16, 0), random_samples(4, 1)
    # The whole vocabulary: a hit needs the random target's argmax, which may lie outside a reduced one.
    full = {"draft_vocab_size": VOCAB}
    DartTrainer(target, train, dev, tmp_path / "dart", small_config(max_steps=30, **full), log=lambda m: None).fit()
    warm = Eagle3Trainer(
        target, train, dev, tmp_path / "e", small_config(max_steps=1, init=str(tmp_path / "dart")), log=lambda m: None
    )
    warm.fit()
    fresh = Eagle3Trainer(target, train, dev, tmp_path / "f", small_config(max_steps=1, **full), log=lambda m: None)
    fresh.fit()
    assert warm.evaluate()["dev_top1"][0] > fresh.evaluate()["dev_top1"][0]
    with pytest.raises(DartspecError, match="layer"):
        Eagle3Trainer(
            target,
            train,
            dev,
            tmp_path / "g",
            small_config(num_layers=2, init=str(tmp_path / "dart")),
            log=lambda m: None,
        ).fit()


@pytest.mark.skipif(not __import__("dartspec.exact").exact.available(), reason="needs gcc and an AVX2 CPU")
def test_fast_steps_compute_the_network_with_8_bit_weights_and_stay_lossless() -> None:
    """On a float32 CPU target the context and tree steps run on the C kernels: they equal the torch network
    with the same 8-bit-rounded weights (level after level, then the next context step with the tree dropped)."""
    import copy

    from dartspec import exact

    t32 = tiny_target("llama")
    t32.model.float()
    model = eagle_for(t32, noise=0.1).float()
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for sub in rounded.modules():
            if isinstance(sub, torch.nn.Linear):
                sub.weight.copy_(exact.unpack(exact.quantize8(sub.weight)))
    fast, ref = Eagle3Drafter(model, t32), Eagle3Drafter(rounded, t32, fast_step=False)
    assert fast._fast is not None and ref._fast is None
    ids = list(np.random.default_rng(3).integers(2, VOCAB, size=20))
    feats = t32.score_sequence(ids).features
    emb = t32.embed(torch.tensor(ids[1:]))
    for d in (fast, ref):
        d.begin(ids)
    (a, ha), (b, hb) = fast._context_step(feats[:10], emb[:10], 0), ref._context_step(feats[:10], emb[:10], 0)
    torch.testing.assert_close(a, b, rtol=0, atol=2e-3)
    kids, pos = t32.embed(torch.tensor([5, 7])), torch.tensor([10, 10])
    kv_f, kv_r = DraftKV(), DraftKV()  # the C path keeps tree nodes in its own cache, after the committed ones
    (la, oa), (lb, ob) = (
        fast._tree_step(torch.stack([ha, ha]), kids, pos, torch.eye(2, dtype=torch.bool), kv_f),
        ref._tree_step(torch.stack([hb, hb]), kids, pos, torch.eye(2, dtype=torch.bool), kv_r),
    )
    torch.testing.assert_close(la, lb, rtol=0, atol=2e-3)
    mask, kid = torch.tensor([[True, False, True]]), t32.embed(torch.tensor([9]))  # a child of the first node
    (la, _), (lb, _) = (
        fast._tree_step(oa[:1], kid, torch.tensor([11]), mask, kv_f),
        ref._tree_step(ob[:1], kid, torch.tensor([11]), mask, kv_r),
    )
    torch.testing.assert_close(la, lb, rtol=0, atol=2e-3)
    (a, _), (b, _) = fast._context_step(feats[10:14], emb[10:14], 10), ref._context_step(feats[10:14], emb[10:14], 10)
    torch.testing.assert_close(a, b, rtol=0, atol=2e-3)
    plain = Generator(t32).generate(list(range(2, 12)), max_new_tokens=40)
    spec = Generator(t32, fast, tree_size=8, max_depth=4).generate(list(range(2, 12)), max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
