"""The DART drafter network, its training objective and trainer, on a tiny random target."""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from dartspec import exact
from dartspec.drafters.dart import DartDrafter
from dartspec.drafters.dart_fast import FastDraftNet
from dartspec.drafters.dart_model import DartConfig, DartModel, DraftKV
from dartspec.engine import Generator
from dartspec.errors import DartspecError
from dartspec.target import Target
from dartspec.train.dart import STATE_FILE, DartTrainer, Sample, TrainConfig, choose_draft_vocab
from dartspec.train.dart_loss import (
    AnchorLayout,
    PaddedLayout,
    anchor_layout,
    anchor_layouts,
    dart_loss,
    sample_anchors,
)
from dartspec.train.evaluate import batch_loss, model_objective

VOCAB = 96


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", unk_token="t0")


def tiny_target(seed: int = 0, layers: int = 6) -> Target:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).to(torch.float64)
    return Target(model, tiny_tokenizer(), name="tiny-llama")


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny_target()


def random_samples(n: int, seed: int, length: tuple[int, int] = (24, 48)) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(*length))
        # A repeating motif makes the data learnable, so training must visibly lower the loss.
        motif = rng.integers(2, VOCAB, size=5)
        tokens = np.concatenate([rng.integers(2, VOCAB, size=6), np.resize(motif, t - 6)]).astype(np.uint16)
        out.append(Sample(tokens, prompt_len=6, index=i))
    return out


def model_for(target: Target, depth: int = 4, vocab: int = 64, seed: int = 0, num_layers: int = 1) -> DartModel:
    torch.manual_seed(seed)
    cfg = DartConfig.for_target(target, draft_vocab_size=vocab, depth=depth, num_layers=num_layers)
    return DartModel(cfg).to(torch.float64)


def test_config_sizes_come_from_target(target: Target) -> None:
    cfg = DartConfig.for_target(target, draft_vocab_size=50, depth=6)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 4, 2, 8)
    assert cfg.feature_layers == (2, 3, 3)
    assert cfg.target_vocab_size == VOCAB and cfg.draft_vocab_size == 50


def test_anchor_layout_masks() -> None:
    lay = anchor_layout(seq_len=10, prompt_len=3, depth=3, anchors=torch.tensor([2, 5]))
    n_real = 9
    assert lay.n_real == n_real and lay.positions.tolist() == [*range(9), 3, 4, 6, 7]
    # Real rows are causal among themselves and never see slots.
    assert torch.equal(lay.mask[:n_real, :n_real], torch.ones(9, 9, dtype=torch.bool).tril())
    assert not lay.mask[:n_real, n_real:].any()
    # Slot 2 of anchor 5 sees real 0..5, slot 1 of its own block and itself, nothing of anchor 2's block.
    row = lay.mask[n_real + 3]
    assert row[:n_real].tolist() == [True] * 6 + [False] * 3
    assert row[n_real:].tolist() == [False, False, True, True]
    # Depth of each row and the target logits row it is scored on (0 = unscored).
    assert lay.depth[n_real:].tolist() == [2, 3, 2, 3]
    assert lay.target_row[n_real:].tolist() == [4, 5, 7, 8]
    # Real row i is scored on the target's logits at i+1 (which predict token i+2) when that is an answer token
    # (index >= 3); the last row uses the target's prediction after the final token, a valid soft label.
    assert lay.depth[:n_real].tolist() == [0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert lay.target_row[:n_real].tolist() == list(range(1, 10))


@pytest.mark.parametrize("num_layers", [1, 2])
def test_training_layout_equals_incremental_drafting(target: Target, num_layers: int) -> None:
    """Every anchor block sees exactly what a drafting step at that position sees."""
    model = model_for(target, depth=4, num_layers=num_layers).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = list(np.random.default_rng(1).integers(2, VOCAB, size=30))
    out = target.score_sequence(ids)
    feats = out.features.clone()
    embeds = target.model.get_input_embeddings()(torch.tensor(ids[1:])).detach()
    anchors = torch.tensor([7, 15, 26])
    lay = anchor_layout(len(ids), 1, 4, anchors)
    with torch.no_grad():
        x_r, h_r = model.real_inputs(feats[: lay.n_real], embeds)
        x_m, h_m = model.mask_inputs(len(anchors) * 3)
        hid = model(torch.cat([x_r, x_m]), torch.cat([h_r, h_m]), lay.positions, lay.mask)
        logp = torch.log_softmax(model.lm_head(hid), -1)
    for k, a in enumerate(anchors.tolist()):
        cache = DraftKV()
        model.step(feats[:5], embeds[:5], 0, cache, depth=1)  # an earlier step's real positions
        step = model.step(feats[5 : a + 1], embeds[5 : a + 1], 5, cache, depth=4)
        rows = [a] + [lay.n_real + 3 * k + j for j in range(3)]
        torch.testing.assert_close(step, logp[rows], rtol=0, atol=1e-9)
        assert cache.length == a + 1


def stack_layouts(layouts: list[AnchorLayout], device: str) -> PaddedLayout:
    """Per-sequence layouts padded into one batch by a plain loop: the reference for the batched builder."""
    batch, n = len(layouts), max(lay.positions.numel() for lay in layouts)
    positions = torch.zeros(batch, n, dtype=torch.long, device=device)
    depth = torch.zeros(batch, n, dtype=torch.long, device=device)
    target_row = torch.zeros(batch, n, dtype=torch.long, device=device)
    mask = torch.eye(n, dtype=torch.bool, device=device).repeat(batch, 1, 1)
    for b, lay in enumerate(layouts):
        m = lay.positions.numel()
        positions[b, :m] = lay.positions
        depth[b, :m] = lay.depth
        target_row[b, :m] = lay.target_row
        mask[b, :m, :m] = lay.mask
    n_real = torch.tensor([lay.n_real for lay in layouts], device=device)
    return PaddedLayout(positions, mask, depth, target_row, n_real, int((depth > 0).sum()))


@pytest.mark.parametrize("depth", [2, 4, 8])
def test_batched_layouts_equal_each_sequences_own(depth: int) -> None:
    """The training step builds every sequence's layout at once; it equals each sequence's own layout, padded:
    sequences of other lengths and prompts, few or no anchors (a sequence too short for any), all anchors."""
    gen = torch.Generator().manual_seed(depth)
    lengths, prompts = [30, 9, 41, 4, 17, 25], [5, 3, 12, 4, 16, 1]
    anchors = [sample_anchors(n, p, 6, gen) for n, p in zip(lengths, prompts, strict=True)]
    anchors[5] = sample_anchors(25, 1, 100, gen)  # every anchor the sequence has
    anchors[0] = torch.tensor([0, 1, 2, 26, 27, 28])  # anchors the sampler never draws: in the prompt, at the end
    assert anchors[3].numel() == 0 and anchors[4].numel() == 1
    got = anchor_layouts(lengths, prompts, anchors, depth, "cpu")
    want = stack_layouts(
        [anchor_layout(n, p, depth, a) for n, p, a in zip(lengths, prompts, anchors, strict=True)], "cpu"
    )
    for name in ("positions", "mask", "depth", "target_row", "n_real", "scored"):
        assert torch.equal(torch.as_tensor(getattr(got, name)), torch.as_tensor(getattr(want, name))), name
    # The scored rows found without reading the device (their count comes from the host) are nonzero's.
    found = got.scored_rows()
    assert all(torch.equal(a, b) for a, b in zip(found, (want.depth > 0).nonzero(as_tuple=True), strict=True))


@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_anchor_loss_scores_each_row_on_its_target_position(target: Target, kind: str) -> None:
    """Per-depth loss, hits and the gradients of the batched objective equal an explicit per-row reference: each
    scored row's draft distribution (the drafter run on its real rows followed by one mask-slot input per slot)
    against the target's full-vocabulary logits at that row's target position."""
    model = model_for(target, depth=4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = list(np.random.default_rng(2).integers(2, VOCAB, size=30))
    out = target.score_sequence(ids)
    feats, logits = out.features.clone(), out.logits.clone()
    embeds = target.model.get_input_embeddings()(torch.tensor(ids[1:])).detach()
    lay = anchor_layout(len(ids), 6, 4, torch.tensor([7, 15, 26]))
    x_r, h_r = model.real_inputs(feats[: lay.n_real], embeds)
    x_m, h_m = model.mask_inputs(9)
    logq = torch.log_softmax(
        model.lm_head(model(torch.cat([x_r, x_m]), torch.cat([h_r, h_m]), lay.positions, lay.mask)), -1
    )
    losses, hits = [[] for _ in range(4)], [0] * 4
    for r in torch.nonzero(lay.depth > 0)[:, 0].tolist():
        full = logits[lay.target_row[r]]
        p = torch.softmax(full[model.d2t], -1)
        loss = -logq[r][p.argmax()] if kind == "ce" else (p * (p.clamp_min(1e-30).log() - logq[r])).sum()
        losses[lay.depth[r] - 1].append(loss)
        hits[lay.depth[r] - 1] += int(model.d2t[logq[r].argmax()] == full.argmax())
    reference = sum(0.6**t * torch.stack(x).mean() for t, x in enumerate(losses))
    want = torch.autograd.grad(reference, list(model.parameters()), allow_unused=True)

    batched = anchor_layouts([len(ids)], [6], [torch.tensor([7, 15, 26])], 4, "cpu")
    got = dart_loss(model, feats[None], embeds[None], logits[None], batched, kind=kind, decay=0.6)
    np.testing.assert_allclose(got.per_depth_loss, [float(torch.stack(x).detach().mean()) for x in losses], rtol=1e-5)
    assert got.per_depth_correct == hits and got.per_depth_count == [len(x) for x in losses]
    grads = torch.autograd.grad(got.loss, list(model.parameters()), allow_unused=True)
    names = [n for n, _ in model.named_parameters()]
    for trained in ("mask_input", "mask_resid", "fc.weight"):  # the slots' inputs and the real rows' are trained
        assert float(want[names.index(trained)].abs().sum()) > 0, trained
    for name, a, b in zip(names, grads, want, strict=True):
        if a is None or b is None:
            assert a is None and b is None, name
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
@pytest.mark.parametrize("num_layers", [1, 2])
def test_fast_step_computes_the_network_with_8_bit_weights(target: Target, num_layers: int) -> None:
    """The C step equals the torch network whose weights are rounded to the same 8-bit groups, step after step
    (its cache keeps real positions only); what is left is the 16-bit rounding of activations."""
    model = model_for(target, depth=4, num_layers=num_layers).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for sub in rounded.modules():
            if isinstance(sub, torch.nn.Linear):
                sub.weight.copy_(exact.unpack(exact.quantize8(sub.weight)))
    assert not torch.equal(rounded.fc.weight, model.fc.weight)
    ids = list(np.random.default_rng(2).integers(2, VOCAB, size=30))
    feats = target.score_sequence(ids).features.float()
    embeds = target.model.get_input_embeddings()(torch.tensor(ids[1:])).detach().float()
    fast, cache = FastDraftNet(model), DraftKV()
    for lo, hi, depth in [(0, 5, 1), (5, 12, 4), (12, 13, 3), (13, 20, 4)]:
        got = fast.dart_step(feats[lo:hi], embeds[lo:hi], lo, depth)
        ref = rounded.step(feats[lo:hi], embeds[lo:hi], lo, cache, depth=depth)
        torch.testing.assert_close(got, ref, rtol=0, atol=2e-3)
        assert fast.cache.length == cache.length == hi
    with pytest.raises(RuntimeError, match="out of step"):
        fast.dart_step(feats[25:27], embeds[25:27], 25, 2)


def test_a_16_bit_drafter_takes_a_float32_targets_features() -> None:
    """`generate --dtype float16 --drafter dart` on a CPU: the drafter is loaded in 16 bits while the lean runtime's
    kernels hand over fp32 features and embeddings (a dtype error in the drafter's first linear layer before)."""
    t32 = tiny_target()
    t32.model.float()
    model = model_for(t32, depth=3).half()
    plain = Generator(t32).generate(list(range(2, 12)), max_new_tokens=24)
    drafter = DartDrafter(model, t32, fast_step=False)  # torch: the C step computes in fp32 anyway
    drafter.embed = lambda ids: t32.embed(ids).half()  # a 16-bit target's embeddings beside its fp32 features
    spec = Generator(t32, drafter, tree_size=6, max_depth=3).generate(list(range(2, 12)), max_new_tokens=24)
    assert spec.token_ids == plain.token_ids and spec.stats.depth_offered[0] > 0  # it drafted


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
def test_dart_drafter_on_the_fast_step_is_lossless() -> None:
    t32 = tiny_target()
    t32.model.float()
    model = model_for(t32, depth=5).float()
    drafter = DartDrafter(model, t32)
    assert drafter._net is not None and DartDrafter(model_for(t32), tiny_target())._net is None  # float64: torch
    plain = Generator(t32).generate(list(range(2, 12)), max_new_tokens=40)
    spec = Generator(t32, drafter, tree_size=8, max_depth=5).generate(list(range(2, 12)), max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
    again = Generator(t32, drafter, tree_size=8, max_depth=5).generate(list(range(2, 12)), max_new_tokens=40)
    assert again.token_ids == plain.token_ids and again.stats.tau == spec.stats.tau  # reset between sequences


def test_save_load_round_trip(tmp_path: Path, target: Target) -> None:
    model = model_for(target)
    model.d2t.copy_(torch.arange(64) + 7)
    model.save(tmp_path, dtype=torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["format"] == "dartspec-dart"
    loaded = DartModel.load(tmp_path, dtype=torch.float64)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=0, atol=1e-6, msg=k)
    assert loaded.d2t.tolist() == list(range(7, 71))
    assert {p.dtype for p in loaded.parameters()} == {torch.float64}
    assert DartModel.load(tmp_path, dtype=torch.float16).fc.weight.dtype == torch.float16
    # Loading imports no torch._dynamo (~0.9 s of every command's start on 2 cores; building the network under
    # torch.device("meta") did, through torch's Python meta kernels)
    import subprocess
    import sys

    code = (
        "import sys\nfrom dartspec.drafters.dart_model import DartModel\nDartModel.load(sys.argv[1])\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_corrupted_and_mismatched_checkpoints(tmp_path: Path, target: Target) -> None:
    model_for(target).save(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(DartspecError, match="corrupted"):
        DartModel.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DartspecError, match="not valid JSON"):
        DartModel.load(tmp_path)
    with pytest.raises(DartspecError, match="not found"):
        DartModel.load(tmp_path / "nowhere")
    # Shapes that disagree with config.json
    model_for(target).save(tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DartspecError, match="does not match"):
        DartModel.load(tmp_path / "a")
    # A drafter for another target
    other = tiny_target(layers=8)
    with pytest.raises(DartspecError, match=r"reads target layers|trained for"):
        DartDrafter(model_for(target), other)


def test_dart_drafter_is_lossless_and_in_step(target: Target) -> None:
    model = model_for(target, depth=5)
    plain = Generator(target).generate(list(range(2, 12)), max_new_tokens=40)
    gen = Generator(target, DartDrafter(model, target), tree_size=8, max_depth=5)
    spec = gen.generate(list(range(2, 12)), max_new_tokens=40)
    assert spec.token_ids == plain.token_ids


def test_draft_vocab_coverage() -> None:
    samples = [Sample(np.array([5, 5, 9, 9, 9, 3]), prompt_len=2)]
    ids, coverage = choose_draft_vocab(samples, 1, VOCAB)
    assert ids.tolist() == [9] and coverage == pytest.approx(0.75)


def test_sample_anchors_in_answer_region() -> None:
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(40, 10, 5, g)
    assert len(a) == 5 and a.min() >= 8 and a.max() <= 37 and torch.equal(a, a.sort().values)
    assert sample_anchors(5, 5, 3, g).numel() == 0


def small_config(**kw) -> TrainConfig:
    base = dict(
        depth=4,
        draft_vocab_size=64,
        lr=3e-3,
        warmup_steps=2,
        max_steps=30,
        seqs_per_step=2,
        anchors_per_seq=8,
        checkpoint_every=5,
        eval_every=1000,
        eval_samples=4,
        precision="fp32",  # the exact comparisons below; auto may pick bf16 for the drafter on this CPU
    )
    base.update(kw)
    return TrainConfig(**base)


def test_training_lowers_the_loss(tmp_path: Path, target: Target) -> None:
    trainer = DartTrainer(
        target, random_samples(16, 0), random_samples(4, 1), tmp_path, small_config(), log=lambda m: None
    )
    trainer.fit()
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    first = np.mean([r["loss"] for r in log[:3]])
    last = np.mean([r["loss"] for r in log[-3:]])
    assert last < 0.8 * first, (first, last)
    ev = trainer.evaluate()
    assert len(ev["dev_top1"]) == 4 and ev["dev_chain_tau_est"] >= 1.0


@pytest.mark.parametrize("sort_steps", [0, 2])
def test_resume_continues_exactly(tmp_path: Path, target: Target, sort_steps: int) -> None:
    cfg = small_config(max_steps=8, checkpoint_every=3, length_sort_steps=sort_steps)
    train, dev = random_samples(10, 0), random_samples(2, 1)
    quiet = dict(log=lambda m: None)
    full = DartTrainer(target, train, dev, tmp_path / "full", cfg, **quiet)
    full.fit()
    ref = [json.loads(x)["loss"] for x in (tmp_path / "full" / "train_log.jsonl").read_text().splitlines()]

    part = DartTrainer(target, train, dev, tmp_path / "part", cfg, **quiet)
    part.fit(stop_after=3)  # stops after step 3, checkpointed
    again = DartTrainer(target, train, dev, tmp_path / "part", cfg, **quiet)
    again.fit(resume=True)
    got = [json.loads(x)["loss"] for x in (tmp_path / "part" / "train_log.jsonl").read_text().splitlines()]
    assert len(got) == len(ref) == 8
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["dart", "eagle3"])
def test_packed_batch_equals_one_sequence_at_a_time(target: Target, kind: str) -> None:
    """Sequences of different lengths scored in one padded forward (target and DART drafter) give each its own
    loss, hits and gradients: no row attends across sequences or to the padding."""
    from dartspec.drafters.eagle3_model import Eagle3Model

    model = model_for(target, depth=4).float()  # the trainers' precision (features arrive as float32)
    if kind == "eagle3":
        model = Eagle3Model(model.cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    samples = [(s.tokens, s.prompt_len) for s in random_samples(3, 5, length=(12, 40))]
    assert len({len(t) for t, _ in samples}) == 3
    objective = model_objective(model, anchors=8)

    def run(chunks: list[list]) -> tuple[list[float], list[int], list[int], list[torch.Tensor]]:
        model.zero_grad()
        gen = torch.Generator().manual_seed(3)
        losses, hits, counts = [], np.zeros(4, int), np.zeros(4, int)
        for chunk in chunks:
            res, n = batch_loss(target, chunk, objective, gen)
            (res.loss * n / len(samples)).backward()
            losses.append(float(res.loss.detach()) * n)
            hits += res.per_depth_correct
            counts += res.per_depth_count
        return [sum(losses)], hits.tolist(), counts.tolist(), [p.grad.clone() for p in model.parameters()]

    packed, alone = run([samples]), run([[s] for s in samples])
    np.testing.assert_allclose(packed[0], alone[0], rtol=1e-6)
    assert packed[1:3] == alone[1:3] and sum(packed[2]) > 0
    for a, b in zip(packed[3], alone[3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_trainer_packing_does_not_change_training(tmp_path: Path, target: Target) -> None:
    train, dev = random_samples(8, 0), random_samples(2, 1)
    logs = []
    for pack in (1, 8):
        cfg = small_config(max_steps=3, pack=pack, length_sort_steps=1)  # the same order for both
        DartTrainer(target, train, dev, tmp_path / str(pack), cfg, log=lambda m: None).fit()
        logs.append(
            [json.loads(x)["loss"] for x in (tmp_path / str(pack) / "train_log.jsonl").read_text().splitlines()]
        )
    np.testing.assert_allclose(logs[0], logs[1], rtol=1e-5)


def test_length_sorted_steps_pad_little_and_keep_every_sample_once(tmp_path: Path, target: Target) -> None:
    """Each epoch's order holds every sample once; within a window of steps, the steps cover disjoint length ranges
    (so a packed forward pads little), and their order is shuffled; the same seed gives the same order."""
    train = random_samples(60, 0, length=(8, 120))
    lengths = np.array([len(s.tokens) for s in train])
    plain = DartTrainer(target, train, [], tmp_path / "a", small_config(seqs_per_step=4, length_sort_steps=1))
    trainer = DartTrainer(target, train, [], tmp_path / "b", small_config(seqs_per_step=4, length_sort_steps=3))
    assert plain.sort_steps == 1 and trainer.sort_steps == 3

    def padded(order: np.ndarray) -> int:  # slots of packed forwards of 4 sequences
        return sum(4 * lengths[order[i : i + 4]].max() for i in range(0, len(order), 4))

    for epoch in (0, 1):
        order = trainer._permutation(epoch)
        assert sorted(order.tolist()) == list(range(60))
        for first in range(0, 60, 12):
            steps = [lengths[order[first + i : first + i + 4]] for i in range(0, 12, 4)]
            spans = sorted((step.min(), step.max()) for step in steps)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
        assert padded(order) < 0.9 * padded(plain._permutation(epoch))
    orders = [trainer._permutation(e) for e in range(4)]
    assert any(not np.array_equal(o[:12], orders[0][:12]) for o in orders[1:])
    again = DartTrainer(target, train, [], tmp_path / "c", small_config(seqs_per_step=4, length_sort_steps=3))
    np.testing.assert_array_equal(again._permutation(1), trainer._permutation(1))


def test_resume_keeps_the_runs_data_order(tmp_path: Path, target: Target) -> None:
    """auto resumes in the order the run was made in (runs from before length sorting: the plain one); another
    number is refused."""
    train, dev = random_samples(12, 0), random_samples(2, 1)
    DartTrainer(target, train, dev, tmp_path, small_config(max_steps=4, length_sort_steps=2), log=lambda m: None).fit(
        stop_after=2
    )
    auto = DartTrainer(target, train, dev, tmp_path, small_config(max_steps=4), log=lambda m: None)
    auto.resume()
    assert auto.sort_steps == 2
    with pytest.raises(DartspecError, match="length_sort_steps"):
        DartTrainer(target, train, dev, tmp_path, small_config(max_steps=4, length_sort_steps=3)).resume()
    state = torch.load(tmp_path / STATE_FILE, weights_only=True)
    del state["sort_steps"]
    torch.save(state, tmp_path / STATE_FILE)
    legacy = DartTrainer(target, train, dev, tmp_path, small_config(max_steps=4, pack=2), log=lambda m: None)
    assert legacy.sort_steps == 16  # auto with packing...
    legacy.resume()
    assert legacy.sort_steps == 1  # ...but an older run goes on in its plain order


def test_auto_precision_follows_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from dartspec.train import dart

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert dart.resolve_precision("auto", cuda) == "bf16" and dart.resolve_precision("fp32", cuda) == "fp32"
    for native, expected in ((True, "bf16-drafter"), (False, "fp32")):
        monkeypatch.setattr(dart, "cpu_has_bf16", lambda native=native: native)
        assert dart.resolve_precision("auto", cpu) == expected
        assert dart.resolve_precision("bf16", cpu) == "bf16"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-drafter"])
def test_precision_picks_what_runs_under_autocast(
    tmp_path: Path, target: Target, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bf16`` autocasts the target's scoring and the drafter; ``bf16-drafter`` only the drafter's training forward
    (features and logits stay the runtime's, evaluation runs as served); its losses stay close to fp32's."""
    train, dev = random_samples(8, 0), random_samples(2, 1)
    seen: dict[str, set[bool]] = {"score": set(), "train": set(), "eval": set()}
    score = type(target).score_batch
    monkeypatch.setattr(
        type(target),
        "score_batch",
        lambda self, seqs: seen["score"].add(torch.is_autocast_enabled("cpu")) or score(self, seqs),
    )
    forward = DartModel.forward
    monkeypatch.setattr(
        DartModel,
        "forward",
        lambda self, *a: (
            seen["train" if self.training else "eval"].add(torch.is_autocast_enabled("cpu")) or forward(self, *a)
        ),
    )
    trainer = DartTrainer(
        target, train, dev, tmp_path / precision, small_config(max_steps=3, precision=precision), log=lambda m: None
    )
    trainer.fit()
    trainer.evaluate()
    bf16 = precision == "bf16"
    assert seen == {"score": {bf16}, "train": {precision != "fp32"}, "eval": {bf16}}
    if precision == "bf16-drafter":  # the same steps as fp32 within bf16's rounding, but not bit for bit
        ref = DartTrainer(target, train, dev, tmp_path / "ref", small_config(max_steps=3), log=lambda m: None)
        ref.fit()
        losses = [
            [json.loads(x)["loss"] for x in (tmp_path / name / "train_log.jsonl").read_text().splitlines()]
            for name in (precision, "ref")
        ]
        np.testing.assert_allclose(losses[0], losses[1], rtol=3e-2)
        assert losses[0] != losses[1]


def test_time_limit_stops_at_a_checkpoint_with_dev_figures(tmp_path: Path, target: Target) -> None:
    train, dev = random_samples(6, 0), random_samples(2, 1)
    cfg = small_config(max_steps=5, checkpoint_every=100, eval_every=100)
    DartTrainer(target, train, dev, tmp_path, cfg, log=lambda m: None).fit(max_seconds=0)
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 1 and "dev_top1" in log[0]  # one step, then out of time: evaluated ...
    again = DartTrainer(target, train, dev, tmp_path, cfg, log=lambda m: None)
    again.fit(resume=True)  # ... and checkpointed: the run continues from step 1
    assert again.step == 5


class StepClock:
    """A fake ``time.monotonic`` for the trainer: each training step takes ``seconds(step)`` of it."""

    def __init__(self, trainer: DartTrainer, seconds: Callable[[int], float]) -> None:
        self.now = 0.0
        step = trainer.train_step

        def timed() -> dict:
            self.now += seconds(trainer.step + 1)
            return step()

        trainer.train_step = timed  # type: ignore[method-assign]

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("slow_start", [False, True])
def test_fit_schedule_ends_the_cosine_when_time_is_up(
    tmp_path: Path, target: Target, monkeypatch: pytest.MonkeyPatch, slow_start: bool
) -> None:
    """--fit-schedule: the schedule is cut to what fits in the time, so the last step runs at the decayed learning
    rate and the run ends at the schedule's end, not mid-schedule; a slow start (a GPU's first steps) is not taken
    as the speed of the rest (the first plan on it alone left a real window's minutes unused)."""
    import dartspec.train.dart as trainer_module

    train, dev = random_samples(6, 0), random_samples(2, 1)
    cfg = small_config(max_steps=1000, checkpoint_every=1000, eval_every=1000, warmup_steps=2, min_lr_ratio=0.05)
    trainer = DartTrainer(target, train, dev, tmp_path, cfg, log=lambda m: None)
    clock = StepClock(trainer, lambda step: 6.0 if slow_start and step <= 10 else 2.0)
    monkeypatch.setattr(trainer_module.time, "monotonic", clock)
    trainer.fit(max_seconds=100, fit_schedule=True)
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    # 2 s a step (after 60 s of slow start): about 50 (or 10 + 20) steps fit; the margin keeps the end inside. A
    # plan on the slow steps alone would stop at 16.
    expected = 30 if slow_start else 50
    assert 0.8 * expected <= trainer.step <= expected
    assert trainer.step == trainer.total_steps  # ended where the schedule ends ...
    assert log[-1]["lr"] == pytest.approx(cfg.lr * cfg.min_lr_ratio, rel=0.1)  # ... at the decayed rate
    resumed = DartTrainer(target, train, dev, tmp_path, cfg, log=lambda m: None)
    resumed.resume()
    assert resumed.total_steps == trainer.total_steps  # the fitted length is saved with the run


def test_fit_schedule_never_lengthens_the_data_schedule(
    tmp_path: Path, target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    train, dev = random_samples(6, 0), random_samples(2, 1)
    cfg = small_config(max_steps=40, checkpoint_every=1000, eval_every=1000)
    trainer = DartTrainer(target, train, dev, tmp_path, cfg, log=lambda m: None)
    import dartspec.train.dart as trainer_module

    monkeypatch.setattr(trainer_module.time, "monotonic", StepClock(trainer, lambda step: 1.0))
    trainer.fit(max_seconds=10_000, fit_schedule=True)
    assert trainer.step == trainer.total_steps == 40


def test_resume_refuses_other_settings_and_overwrites(tmp_path: Path, target: Target) -> None:
    train, dev = random_samples(6, 0), random_samples(2, 1)
    DartTrainer(target, train, dev, tmp_path, small_config(max_steps=2), log=lambda m: None).fit()
    with pytest.raises(DartspecError, match="already holds"):
        DartTrainer(target, train, dev, tmp_path, small_config(max_steps=2), log=lambda m: None).fit()
    with pytest.raises(DartspecError, match="different settings"):
        DartTrainer(target, train, dev, tmp_path, small_config(max_steps=2, lr=1.0), log=lambda m: None).fit(
            resume=True
        )
    (tmp_path / STATE_FILE).write_bytes(b"broken")
    with pytest.raises(DartspecError, match="corrupted"):
        DartTrainer(target, train, dev, tmp_path, small_config(max_steps=2), log=lambda m: None).fit(resume=True)


def test_warm_start_from_a_checkpoint(tmp_path: Path, target: Target) -> None:
    train, dev = random_samples(16, 0), random_samples(4, 1)
    first = DartTrainer(target, train, dev, tmp_path / "a", small_config(max_steps=30), log=lambda m: None)
    first.fit()
    fresh = DartTrainer(target, train, dev, tmp_path / "b", small_config(max_steps=1), log=lambda m: None)
    fresh.fit()
    warm = DartTrainer(
        target, train, dev, tmp_path / "c", small_config(max_steps=1, init=str(tmp_path / "a")), log=lambda m: None
    )
    warm.fit()
    assert torch.equal(warm.model.d2t, first.model.d2t)
    assert warm.evaluate()["dev_loss"] < 0.9 * fresh.evaluate()["dev_loss"]
    with pytest.raises(DartspecError, match="depth 4"):
        DartTrainer(
            target, train, dev, tmp_path / "d", small_config(depth=5, init=str(tmp_path / "a")), log=lambda m: None
        ).fit()


def test_hybrid_merges_lookup_spans_and_stays_lossless(target: Target) -> None:
    from dartspec.drafters.base import DraftBudget
    from dartspec.drafters.hybrid import HybridDrafter

    model = model_for(target, depth=5)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    plain = Generator(target).generate(prompt, max_new_tokens=40)
    hybrid = HybridDrafter(DartDrafter(model, target, "beam"))
    out = Generator(target, hybrid, tree_size=10, max_depth=5).generate(prompt, max_new_tokens=40)
    assert out.token_ids == plain.token_ids

    # One proposal, by hand: the lookup span 7 8 9 5 6 comes first, the DART guesses fill the rest.
    hybrid.begin(prompt)
    feats = target.prefill(prompt, features=True).features
    hybrid.observe(prompt, feats)
    tokens = [*prompt, 7]
    tree = hybrid.propose(tokens, DraftBudget(max_nodes=10, max_depth=5))
    assert tree.tokens[1:6].tolist() == [8, 9, 5, 6, 7] and tree.size == 10  # DART filled the nodes left
    # Spans that fill a budget leave no room: the tree is theirs and DART drafts nothing (its features wait).
    hybrid.begin(prompt)
    target.reset()
    hybrid.observe(prompt, target.prefill(prompt, features=True).features)
    small = hybrid.propose(tokens, DraftBudget(max_nodes=4, max_depth=5))
    assert small.tokens.tolist() == [7, 8, 9, 5] and hybrid.drafter._queue.pending
    target.reset()


def test_hybrid_caps_the_drafters_share_but_not_the_spans(target: Target) -> None:
    """``draft_nodes``: the lookup's spans may use the whole budget, the DART tree at most its cap (without a match
    too); lossless either way."""
    from dartspec.drafters.base import DraftBudget
    from dartspec.drafters.hybrid import HybridDrafter

    model = model_for(target, depth=5)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    plain = Generator(target).generate(prompt, max_new_tokens=40)
    capped = HybridDrafter(DartDrafter(model, target, "beam"), draft_nodes=2)
    assert Generator(target, capped, tree_size=5, max_depth=5).generate(prompt, max_new_tokens=40).token_ids == (
        plain.token_ids
    )
    budgets: list[DraftBudget] = []
    propose = capped.drafter.propose
    capped.drafter.propose = lambda tokens, budget: budgets.append(budget) or propose(tokens, budget)
    for tokens, spans in (([*prompt, 7], [8, 9, 5, 6, 7]), ([*prompt, 11], None)):  # a match, and none
        target.reset()
        capped.begin(prompt)
        capped.observe(prompt, target.prefill(prompt, features=True).features)
        tree = capped.propose(tokens, DraftBudget(max_nodes=8, max_depth=5))
        if spans:  # the span fills 6 of the 8 nodes; DART gets 2 of the 3 nodes left (root shared)
            assert tree.tokens[1:6].tolist() == spans and budgets[-1].max_nodes == 2 and tree.size <= 7
        else:
            assert budgets[-1].max_nodes == 2 and tree.size <= 2
    # In a batched step the nodes the batch took come out of DART's share first: here all of it.
    target.reset()
    capped.begin(prompt)
    capped.observe(prompt, target.prefill(prompt, features=True).features)
    tree = capped.propose([*prompt, 11], DraftBudget(max_nodes=2, max_depth=5, batch_cut=2))
    assert budgets[-1].max_nodes == 1 and tree.size == 1
    with pytest.raises(ValueError, match="draft_nodes"):
        HybridDrafter(DartDrafter(model, target, "beam"), draft_nodes=0)


def test_hybrid_network_stops_drafting_past_its_context_and_stays_lossless(target: Target) -> None:
    """``draft_context``: the DART tree while the context is at most that long, then the lookup's spans alone for the
    rest of the sequence (a longer prompt: never the network, which then reads no features); the output is plain
    decoding's either way, and ``--json`` says where the network stopped."""
    from dartspec.drafters.hybrid import HybridDrafter

    model = model_for(target, depth=5)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    plain = Generator(target).generate(prompt, max_new_tokens=30)
    for limit, drafts in ((len(prompt) + 10, True), (len(prompt) - 1, False)):
        hybrid = HybridDrafter(DartDrafter(model, target, "beam"), draft_nodes=3, draft_context=limit)
        contexts: list[int] = []  # the contexts the network drafted in
        seen: list[int] = []  # the features it read
        net = hybrid.drafter
        net.propose = lambda tokens, budget, log=contexts, f=net.propose: log.append(len(tokens)) or f(tokens, budget)
        net.observe = lambda ids, feats, log=seen, f=net.observe: log.append(len(ids)) or f(ids, feats)
        out = Generator(target, hybrid, tree_size=4, max_depth=5).generate(prompt, max_new_tokens=30)
        assert out.token_ids == plain.token_ids
        assert all(c <= limit for c in contexts) and bool(contexts) == drafts
        assert bool(seen) == drafts  # a prompt past the limit: the network never reads features
        assert out.stats.extra["lookup_only_from"] == (limit + 1 if drafts else len(prompt))
        assert out.stats.tau > 1.0  # the spans still draft (the prompt repeats itself)
    with pytest.raises(ValueError, match="draft_context"):
        HybridDrafter(DartDrafter(model, target, "beam"), draft_context=0)


def test_build_generator_gives_dart_with_lookup_its_default_cap_only_at_the_default_size(
    tmp_path: Path, target: Target
) -> None:
    from dartspec.methods import GeneratorSpec, build_generator

    model_for(target).save(tmp_path)
    default = build_generator(target, GeneratorSpec(drafter="dart+pld", path=str(tmp_path)))
    assert (default.tree_size, default.drafter.draft_nodes, default.drafter.draft_context) == (4, 3, 512)
    sized = build_generator(target, GeneratorSpec(drafter="dart+pld", path=str(tmp_path), tree_size=6))
    # an explicit size: no cap unless asked, and the network drafts at every context
    assert (sized.tree_size, sized.drafter.draft_nodes, sized.drafter.draft_context) == (6, None, None)
    both = build_generator(target, GeneratorSpec(drafter="dart+pld", path=str(tmp_path), tree_size=6, draft_nodes=3))
    assert (both.tree_size, both.drafter.draft_nodes) == (6, 3)
    dart = build_generator(target, GeneratorSpec(drafter="dart", path=str(tmp_path)))
    assert dart.tree_size == 2
    with pytest.raises(DartspecError, match="applies to dart\\+pld, draft-model\\+pld only; the drafter here is pld"):
        build_generator(target, GeneratorSpec(drafter="auto", draft_nodes=2))  # no DART drafter ships: pld
    # An option the drafter does not read is refused (it was silently ignored); auto's choice is the machine's
    for name, option, message in [
        ("pld", {"tree": "ddtree"}, r"--tree \(tree=\) applies to dart, dart\+pld, dflash only; .* here is pld"),
        ("none", {"path": str(tmp_path)}, "--drafter-path .* the drafter here is none"),
        ("dart", {"topk": 8}, r"--topk \(topk=\) applies to eagle3 only"),
        ("eagle3", {"online_ngram": True}, "--online-ngram"),
        ("draft-model", {"ngram_smoothing": 0.5}, "--ngram-smoothing"),
    ]:
        with pytest.raises(DartspecError, match=message):
            build_generator(target, GeneratorSpec(drafter=name, **option))
    assert build_generator(target, GeneratorSpec(drafter="auto", tree="ddtree")).drafter.name == "pld"
    sampled = build_generator(target, GeneratorSpec(drafter="dart+pld", path=str(tmp_path), sampled_drafts=True))
    assert sampled.sampled_drafts and not default.sampled_drafts
    for name in ("auto", "pld", "eagle3"):  # prompt lookup's spans and EAGLE-3's levels are fixed guesses
        with pytest.raises(
            DartspecError, match=r"--sampled-drafts applies to .*\(dart, dart\+pld, dflash, draft-model"
        ):
            build_generator(target, GeneratorSpec(drafter=name, sampled_drafts=True))


def test_hybrid_builds_three_lookup_spans_and_one_under_the_auto_sizer(tmp_path: Path, target: Target) -> None:
    """The registry's ``dart+pld``: three continuations at a fixed budget (chosen on development answers); with
    ``--tree-size auto`` one, since the sizer's cost model cuts only the DART tree."""
    from dartspec.drafters import make_drafter

    model_for(target).save(tmp_path)
    fixed = make_drafter("dart+pld", target, tmp_path)
    auto = make_drafter("dart+pld", target, tmp_path, auto_size=True)
    assert (fixed.lookup.max_matches, auto.lookup.max_matches) == (3, 1)
    assert auto.drafter.auto is not None and fixed.drafter.auto is None


def test_drafters_on_other_feature_layers_share_one_target(tmp_path: Path, target: Target) -> None:
    """Training on chosen layers stores them; each drafter switches the target to its own before drafting."""
    cfg = small_config(max_steps=2, feature_layers=[1, 4, 5])
    DartTrainer(target, random_samples(4, 0), [], tmp_path / "b", cfg, log=lambda m: None).fit()
    assert target.feature_layers == (1, 4, 5)
    other = DartModel.load(tmp_path / "b", dtype=torch.float64)
    assert other.cfg.feature_layers == (1, 4, 5)
    target.set_feature_layers(None)
    with pytest.raises(DartspecError, match="reads target layers"):
        small = tiny_target(layers=3)  # same tokenizer and sizes, too few layers
        DartDrafter(other, small)

    mine = DartDrafter(model_for(target, depth=4), target, "beam")
    trees: list = []
    propose = mine.propose
    mine.propose = lambda tokens, budget: trees.append(propose(tokens, budget)) or trees[-1]
    prompt = list(range(2, 12))
    plain = Generator(target).generate(prompt, max_new_tokens=16).token_ids
    mine_gen = Generator(target, mine, tree_size=6, max_depth=4)
    assert mine_gen.generate(prompt, max_new_tokens=16).token_ids == plain
    first = [t.tokens.tolist() for t in trees]
    spec = Generator(target, DartDrafter(other, target, "beam"), tree_size=6, max_depth=4).generate(
        prompt, max_new_tokens=16
    )
    assert spec.token_ids == plain and target.feature_layers == (1, 4, 5)
    trees.clear()
    assert mine_gen.generate(prompt, max_new_tokens=16).token_ids == plain
    assert [t.tokens.tolist() for t in trees] == first  # fed its own layers again, so the same drafts
    assert target.feature_layers == (2, 3, 3)


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        ("loss: mse", "loss must be kl or ce"),
        ("depth: 0", "depth must be a positive integer"),
        ("lr: -1e-4", "lr must be positive"),
        ("lr: fast", "lr must be a number"),
        ("seqs_per_step: many", "seqs_per_step must be a positive integer"),
        ("feature_layers: []", "feature_layers must list layer numbers"),
        ("max_steps: -5", "max_steps"),
        ("epochs: 0", "epochs > 0"),
        ("learning_rate: 0.1", "unknown training options ['learning_rate']"),
    ],
)
def test_bad_training_options_are_named(tmp_path: Path, yaml_text: str, needle: str) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(yaml_text + "\n")
    with pytest.raises(DartspecError) as err:
        TrainConfig.from_file(path)
    assert needle in str(err.value)


def test_yaml_exponents_without_a_dot_are_numbers(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text("lr: 2e-5\ndepth_decay: 0.8\n")
    cfg = TrainConfig.from_file(path)
    assert cfg.lr == 2e-5 and cfg.depth_decay == 0.8


def test_a_crash_between_state_and_export_resumes_exactly(tmp_path: Path, target: Target) -> None:
    """The state file is the whole checkpoint: exported weights from another step (a kill after the state's
    rename, before the export) cannot leak into the resumed run, and log lines of redone steps are cut."""
    cfg = small_config(max_steps=8, checkpoint_every=3)
    train, dev = random_samples(10, 0), random_samples(2, 1)
    full = DartTrainer(target, train, dev, tmp_path / "full", cfg, log=lambda m: None)
    full.fit()
    ref = [json.loads(x)["loss"] for x in (tmp_path / "full" / "train_log.jsonl").read_text().splitlines()]

    part = DartTrainer(target, train, dev, tmp_path / "part", cfg, log=lambda m: None)
    part.fit(stop_after=4)  # checkpoint at step 3 and at the stop, step 4
    state = torch.load(tmp_path / "part" / STATE_FILE, weights_only=True)
    assert state["step"] == 4
    # As if killed later: the export holds other weights, and steps 5-6 were logged but never checkpointed.
    DartModel.load(tmp_path / "full").save(tmp_path / "part", dtype=torch.float32)
    with open(tmp_path / "part" / "train_log.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "loss": 0.0}) + "\n" + json.dumps({"step": 6, "loss": 0.0}) + "\n{torn")
    DartTrainer(target, train, dev, tmp_path / "part", cfg, log=lambda m: None).fit(resume=True)
    rows = [json.loads(x) for x in (tmp_path / "part" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    np.testing.assert_allclose([r["loss"] for r in rows], ref, rtol=1e-9, atol=1e-12)


def test_resume_refuses_other_data_and_incomplete_state(tmp_path: Path, target: Target) -> None:
    cfg = small_config(max_steps=4)
    train, dev = random_samples(10, 0), random_samples(2, 1)
    DartTrainer(target, train, dev, tmp_path, cfg, log=lambda m: None).fit(stop_after=2)
    other = random_samples(10, 5)
    with pytest.raises(DartspecError, match=r"other data .*--new-data"):
        DartTrainer(target, other, dev, tmp_path, cfg, log=lambda m: None).fit(resume=True)
    DartTrainer(target, other, dev, tmp_path, cfg, log=lambda m: None).fit(resume=True, new_data=True, stop_after=1)
    state = torch.load(tmp_path / STATE_FILE, weights_only=True)
    del state["optimizer"]
    torch.save(state, tmp_path / STATE_FILE)
    with pytest.raises(DartspecError, match=r"incomplete .*optimizer"):
        DartTrainer(target, other, dev, tmp_path, cfg, log=lambda m: None).fit(resume=True, new_data=True)


def test_int8_storage_round_trip(tmp_path: Path) -> None:
    """``save(int8=True)``: matrices as int8 rows + a scale per row (within half a grid step of each weight), the
    rest as fp16; loads back into floats; ``recast_checkpoint`` writes the same file from an fp32 export; a damaged
    scale is a clear error."""
    from safetensors.torch import load_file, save_file

    from dartspec.drafters.dart_model import SCALE_SUFFIX, recast_checkpoint

    target = tiny_target()
    model = model_for(target)
    model.save(tmp_path / "fp32", dtype=torch.float32)
    model.save(tmp_path / "int8", int8=True)
    stored = load_file(str(tmp_path / "int8" / "model.safetensors"))
    assert stored["fc.weight"].dtype == torch.int8 and stored["fc.weight" + SCALE_SUFFIX].shape == (32, 1)
    assert stored["mask_resid"].dtype == torch.float16
    loaded = DartModel.load(tmp_path / "int8")
    for name, value in model.state_dict().items():
        if value.dim() == 2:
            step = value.abs().amax(dim=1, keepdim=True) / 127
            assert bool(((loaded.state_dict()[name] - value).abs() <= step / 2 + 1e-7).all()), name
    recast_checkpoint(tmp_path / "fp32", tmp_path / "recast", int8=True)
    again = load_file(str(tmp_path / "recast" / "model.safetensors"))
    assert all(torch.equal(again[k], stored[k]) for k in stored)
    stored["fc.weight" + SCALE_SUFFIX] = stored["fc.weight" + SCALE_SUFFIX][:3]
    save_file(stored, str(tmp_path / "int8" / "model.safetensors"))
    with pytest.raises(DartspecError, match="corrupted"):
        DartModel.load(tmp_path / "int8")
