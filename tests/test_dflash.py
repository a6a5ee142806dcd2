"""The DFlash drafter: KV injection, the training layout against incremental drafting, training, persistence,
packing, lossless generation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_dart import VOCAB, random_samples, small_config, tiny_target

from dartspec.drafters import make_drafter
from dartspec.drafters.dart_model import DartConfig, DraftKV, rotary
from dartspec.drafters.dflash_model import DFlashModel, dflash_feature_layers
from dartspec.engine import Generator
from dartspec.errors import DartspecError
from dartspec.target import Target
from dartspec.train.dflash import DEFAULTS, DFlashTrainer
from dartspec.train.dflash_loss import REFERENCE_DECAY, dflash_loss
from dartspec.train.evaluate import batch_loss, model_objective


@pytest.fixture(scope="module")
def tiny() -> Target:
    return tiny_target()


def dflash_for(target: Target, depth: int = 4, layers: int = 2, vocab: int = 64, seed: int = 0) -> DFlashModel:
    torch.manual_seed(seed)
    target.set_feature_layers(dflash_feature_layers(target.num_layers))
    cfg = DartConfig.for_target(target, draft_vocab_size=vocab, depth=depth, num_layers=layers)
    model = DFlashModel(cfg).to(torch.float64)
    with torch.no_grad():  # away from the initialisation, so that every part matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def test_feature_layers_spread_over_the_depth() -> None:
    assert dflash_feature_layers(30) == (1, 8, 14, 21, 28)
    assert dflash_feature_layers(6) == (1, 2, 3, 4)  # 5 spread over 1..4: four distinct layers
    assert dflash_feature_layers(3) == (0, 1, 2)


def test_kv_injection_equals_attention_over_the_concatenated_rows(tiny: Target) -> None:
    """A layer attending to injected context keys/values computes, for its block rows, what one attention over
    [context rows ; block rows] computes (the context rows' queries unused), written out here by hand."""
    model = dflash_for(tiny)
    layer, cfg = model.layers[0], model.cfg
    ctx = torch.randn(7, cfg.hidden_size, dtype=torch.float64)
    h = torch.randn(5, cfg.hidden_size, dtype=torch.float64)
    ctx_pos, pos = torch.arange(7), torch.arange(7, 12)
    with torch.no_grad():
        got = layer(h, pos, layer.kv(ctx, ctx_pos))
        # By hand: the rows [ctx ; norm(h)] through the layer's k/v projections, softmax attention, residual, MLP.
        rows = torch.cat([ctx, layer.input_norm(h)])
        all_pos = torch.cat([ctx_pos, pos])

        def heads(x, n):
            return x.view(x.shape[0], n, cfg.head_dim).transpose(0, 1)

        q = rotary(heads(layer.q_proj(layer.input_norm(h)), cfg.num_attention_heads), pos, cfg.rope_theta)
        k = rotary(heads(layer.k_proj(rows), cfg.num_key_value_heads), all_pos, cfg.rope_theta)
        v = heads(layer.v_proj(rows), cfg.num_key_value_heads)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        weights = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(cfg.head_dim), -1)
        out = h + layer.o_proj((weights @ v).transpose(0, 1).reshape(5, -1))
        x = layer.post_norm(out)
        want = out + layer.down_proj(torch.nn.functional.silu(layer.gate_proj(x)) * layer.up_proj(x))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_training_layout_equals_incremental_drafting(tiny: Target) -> None:
    """Every anchor block of the training objective sees exactly what a drafting step at that anchor sees: its
    depth rows' log-probabilities equal :meth:`DFlashModel.step`'s, with the context fed in two steps."""
    model = dflash_for(tiny, depth=4)
    ids = list(np.random.default_rng(1).integers(2, VOCAB, size=30))
    out = tiny.score_sequence(ids)
    feats = out.features.clone()
    embeds = tiny.model.get_input_embeddings()(torch.tensor(ids[1:])).detach()
    anchors = torch.tensor([6, 15, 27])
    captured = {}
    real_distill = dflash_loss.__globals__["distill"]

    def spy(draft_logits, target_logits, d2t, kind):
        captured["logp"] = torch.log_softmax(draft_logits, -1)
        return real_distill(draft_logits, target_logits, d2t, kind)

    dflash_loss.__globals__["distill"] = spy
    try:
        with torch.no_grad():
            dflash_loss(model, feats[None], embeds[None], out.logits[None], [30], [1], [anchors])
    finally:
        dflash_loss.__globals__["distill"] = real_distill
    # Scored rows come anchor by anchor, depth 1..4 (x_{a+k} must exist: the last anchor has 2).
    rows = iter(captured["logp"])
    for a in anchors.tolist():
        cache = DraftKV()
        model.step(feats[:4], embeds[:4], 0, cache)  # an earlier step's committed positions
        step = model.step(feats[4:a], embeds[4:a], 4, cache)  # the root is token a (embeds row a-1)
        assert cache.length == a
        for k in range(min(4, len(ids) - 1 - a)):
            torch.testing.assert_close(next(rows), step[k], rtol=0, atol=1e-9)
    assert next(rows, None) is None


def test_packed_batch_equals_one_sequence_at_a_time(tiny: Target) -> None:
    """Sequences of different lengths in one padded forward: each its own loss and gradients."""
    model = dflash_for(tiny).float().train()
    samples = [(s.tokens, s.prompt_len) for s in random_samples(3, 5, length=(12, 40))]
    objective = model_objective(model, anchors=6, decay=REFERENCE_DECAY, kind="ce")

    def run(chunks):
        model.zero_grad()
        gen = torch.Generator().manual_seed(3)
        losses = []
        for chunk in chunks:
            res, n = batch_loss(tiny, chunk, objective, gen)
            (res.loss * n / 3).backward()
            losses.append(float(res.loss.detach()) * n)
        return sum(losses), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    packed, g_packed = run([samples])
    alone, g_alone = run([[s] for s in samples])
    assert packed == pytest.approx(alone, rel=1e-5)
    for a, b in zip(g_packed, g_alone, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert model.lm_head.weight.grad is None  # the tiny's head rows stay frozen


def test_training_lowers_the_loss_saves_loads_and_resumes(tmp_path: Path, tiny: Target) -> None:
    cfg = small_config(**{**DEFAULTS, "loss": "kl"}, max_steps=30)  # KL: a visible fall in 30 steps
    train, dev = random_samples(16, 0), random_samples(4, 1)
    trainer = DFlashTrainer(tiny, train, dev, tmp_path / "a", cfg, log=lambda m: None)
    trainer.fit()
    log = [json.loads(line) for line in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert np.mean([r["loss"] for r in log[-3:]]) < 0.8 * np.mean([r["loss"] for r in log[:3]])
    assert len(trainer.evaluate()["dev_top1"]) == 4
    # The frozen head is the target's rows: not stored, rebuilt from the target at load (and refused without it).
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "fc.weight" in names
    with pytest.raises(DartspecError, match=r"takes lm_head\.weight from its target"):
        DFlashModel.load(tmp_path / "a")
    loaded = DFlashModel.load(tmp_path / "a", target=tiny)
    assert loaded.cfg.format == "dartspec-dflash" and loaded.cfg.feature_layers == dflash_feature_layers(6)
    assert torch.equal(loaded.lm_head.weight, tiny.lm_head_weight()[loaded.d2t].float())
    for name, value in trainer.model.state_dict().items():
        want = value.float() if value.is_floating_point() else value
        torch.testing.assert_close(loaded.state_dict()[name], want, msg=name)
    with pytest.raises(DartspecError, match="dartspec-dart"):
        from dartspec.drafters.dart_model import DartModel

        DartModel.load(tmp_path / "a")  # a DFlash checkpoint is not a DART one
    # Resume continues exactly.
    short = small_config(**DEFAULTS, max_steps=6, checkpoint_every=2)
    full = DFlashTrainer(tiny, train, dev, tmp_path / "full", short, log=lambda m: None)
    full.fit()
    part = DFlashTrainer(tiny, train, dev, tmp_path / "part", short, log=lambda m: None)
    part.fit(stop_after=2)
    DFlashTrainer(tiny, train, dev, tmp_path / "part", short, log=lambda m: None).fit(resume=True)

    def losses(folder):
        return [json.loads(x)["loss"] for x in (tmp_path / folder / "train_log.jsonl").read_text().splitlines()]

    np.testing.assert_allclose(losses("part"), losses("full"), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_dflash_generation_is_lossless(tmp_path: Path, temperature: float) -> None:
    from test_lossless import prompts, untied_target

    target = untied_target("llama", torch.float32)
    dflash_for(target).float().save(tmp_path / "dflash")
    spec = Generator(target, make_drafter("dflash", target, tmp_path / "dflash", tree="ddtree"), tree_size=6)
    plain = Generator(target)
    for p in prompts(3):
        want = plain.generate(p, max_new_tokens=24, temperature=temperature, seed=7).token_ids
        got = spec.generate(p, max_new_tokens=24, temperature=temperature, seed=7)
        assert got.token_ids == want
        assert got.stats.target_forwards <= 25
