"""A GGUF's Q4_K / Q6_K blocks as integer groups (dartspec.kquants), checked against gguf's own dequantization."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_tokenizer
from test_lean import _gguf_like, _random_tree, _step_by_step

from dartspec import exact, kquants
from dartspec.lean import LeanTarget
from dartspec.model_cache import MANIFEST_NAME
from dartspec.targets import describe, wrap_model

gguf = pytest.importorskip("gguf")


def random_q4_k(rng: np.random.Generator, rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
    """Raw Q4_K bytes ``(rows, cols / 256 * 144)``: fp16 d and dmin of plausible size (times ``scale``), random 6-bit
    scales and minimums, random nibbles."""
    blocks = rows * cols // kquants.SUPER_BLOCK
    d = ((rng.random((blocks, 1)) * 1e-3 + 1e-4) * scale).astype(np.float16).view(np.uint8)
    dmin = (rng.random((blocks, 1)) * 1e-3 * scale).astype(np.float16).view(np.uint8)
    rest = rng.integers(0, 256, (blocks, 12 + 128), dtype=np.uint8)
    return np.concatenate([d, dmin, rest], axis=1).reshape(rows, -1)


def random_q5_k(rng: np.random.Generator, rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
    """Raw Q5_K bytes ``(rows, cols / 256 * 176)``: as :func:`random_q4_k`'s with 32 bytes of fifth bits."""
    q4 = random_q4_k(rng, rows, cols, scale / 2).reshape(-1, 144)  # 5-bit values: half the step for the same range
    fifth = rng.integers(0, 256, (q4.shape[0], 32), dtype=np.uint8)
    return np.concatenate([q4[:, :16], fifth, q4[:, 16:]], axis=1).reshape(rows, -1)


def random_q6_k(rng: np.random.Generator, rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
    """Raw Q6_K bytes ``(rows, cols / 256 * 210)``: random 6-bit values and int8 scales, a small fp16 d (times
    ``scale``)."""
    blocks = rows * cols // kquants.SUPER_BLOCK
    quants = rng.integers(0, 256, (blocks, 192), dtype=np.uint8)
    scales = rng.integers(-128, 128, (blocks, 16)).astype(np.int8).view(np.uint8)
    d = ((rng.random((blocks, 1)) * 1e-4 + 1e-6) * scale).astype(np.float16).view(np.uint8)
    return np.concatenate([quants, scales, d], axis=1).reshape(rows, -1)


def assert_tree_rows_decode_alone(target: LeanTarget, prompt: list[int], seed: int) -> None:
    """Each row of a random tree's verification equals that path decoded one token at a time, bit for bit."""
    tree = _random_tree(np.random.default_rng(seed), 7, 9)
    target.prefill(prompt)
    rows = target.verify(tree).logits
    for node in range(tree.size):
        path = [int(tree.tokens[i]) for i in tree.path_to(node)]
        assert torch.equal(rows[node], _step_by_step(target, prompt, path))


def dequantized(raw: np.ndarray, kind: gguf.GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, kind).astype(np.float32))


@pytest.mark.parametrize("block", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_groups_are_ggufs_own_numbers(block: str) -> None:
    """Every weight of the groups (``D q + M``, or ``D q`` per half group) in fp32 equals gguf's dequantization, bit for
    bit, and so does the packed-weight cache's form of them."""
    make, read, kind, width = {
        "Q4_K": (random_q4_k, kquants.q4_k_groups, 4, 16),
        "Q5_K": (random_q5_k, kquants.q5_k_groups, 5, 32),
        "Q6_K": (random_q6_k, kquants.q6_k_groups, 6, 32),
    }[block]
    raw = make(np.random.default_rng(0), 6, 512)
    groups = read(raw, 6, 512)
    assert groups.kind == kind and groups.scale.dtype == torch.float32 and groups.data.shape == (6, 16, width)
    want = dequantized(raw, getattr(gguf.GGMLQuantizationType, block))
    assert torch.equal(exact.unpack(groups), want)
    if block != "Q5_K":  # the file's own form (codes, super-block numbers) gives the same scales and offsets
        codes, numbers = (c.float() for c in groups.codes)
        per_group = numbers.repeat_interleave(8, dim=1)  # a super-block's d (and -dmin) for each of its 8 groups
        if block == "Q4_K":
            assert torch.equal(per_group[..., 0] * codes[..., 0], groups.scale)
            assert torch.equal(per_group[..., 1] * codes[..., 1], groups.offset)
        else:
            assert torch.equal(per_group * codes, groups.scale)  # a code per half group, one d per super-block
    assert torch.equal(exact.unpack(exact.from_tensors(exact.to_tensors(groups))), want)
    with pytest.raises(ValueError, match="super-blocks"):
        read(raw, 12, 256 + 32)


def _tiny_qwen2() -> torch.nn.Module:
    """Three Qwen2 layers whose MLP is 256 wide: down projections of whole K-quant super-blocks."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen2Config(
        vocab_size=512, hidden_size=32, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1, tie_word_embeddings=True,
    )  # fmt: skip
    return _gguf_like(tf.Qwen2ForCausalLM(cfg).float().eval())


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
def test_lean_takes_k_quant_groups_from_the_source_gguf(tmp_path, monkeypatch) -> None:
    """A converted model whose GGUF holds Q4_K and Q6_K down projections: the lean runtime reads their groups from the
    file (named by its manifest) and runs them as exact-a16 groups (kinds 4 and 6) instead of fp16 panels; a tensor
    whose groups do not reproduce the loaded weight (here: one weight changed after conversion) stays fp16. The result
    is the same model: logits as the unquantized forward's, every tree row equal to that token decoded alone, bit for
    bit."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("DARTSPEC_CACHE", str(tmp_path / "cache"))
    model = _tiny_qwen2()
    rng = np.random.default_rng(1)
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(3)
    Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    with torch.no_grad():
        for i, (layer, kind) in enumerate(zip(model.model.layers, (Q4_K, Q6_K, Q4_K), strict=True)):
            raw = (random_q4_k if kind == Q4_K else random_q6_k)(rng, 32, 256)
            layer.mlp.down_proj.weight.copy_(dequantized(raw, kind))
            writer.add_tensor(f"blk.{i}.ffn_down.weight", raw, raw_dtype=kind)
        model.model.layers[2].mlp.down_proj.weight[3, 5] += 1e-3  # no longer the file's numbers
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = tmp_path / "converted"
    model.save_pretrained(folder)
    source = {"file": path.name, "path": str(path), "size": path.stat().st_size}
    (folder / MANIFEST_NAME).write_text(json.dumps({"source": source}))
    assert kquants.source_gguf(folder) == path

    loaded = AutoModelForCausalLM.from_pretrained(folder)
    target = wrap_model(loaded, tiny_tokenizer())
    assert describe(target) == "lean/exact-a16+fp16"
    down = [layer.down for layer in target.layers]
    assert [(lin.fmt, lin.packed.kind) for lin in down] == [("exact-a16", 4), ("exact-a16", 6), ("fp16", 16)]
    assert down[0].packed.scale.dtype == torch.uint8  # the file's codes (kernel: d * sc), not fp32 scales
    ids = list(range(3, 40))
    ref = LeanTarget(loaded, tiny_tokenizer(), quant="none")
    torch.testing.assert_close(target.score_sequence(ids).logits, ref.score_sequence(ids).logits, rtol=5e-3, atol=5e-3)
    assert_tree_rows_decode_alone(target, ids[:12], seed=2)
    # The packed-weight cache keeps what the file gave: a second load reads neither the GGUF nor packs again.
    monkeypatch.setattr(kquants, "file_groups", lambda *a: pytest.fail("read the GGUF although the cache has it"))
    again = wrap_model(AutoModelForCausalLM.from_pretrained(folder), tiny_tokenizer())
    assert [lin.packed.kind for lin in (layer.down for layer in again.layers)] == [4, 6, 16]
    assert torch.equal(again.score_sequence(ids).logits, target.score_sequence(ids).logits)


def test_a_gguf_without_k_quant_blocks_is_not_read_again(tmp_path, monkeypatch) -> None:
    """The conversion records the file's tensor kinds (with the reader it parsed anyway); a file of none of Q4_K, Q5_K
    and Q6_K is then not parsed again for groups (seconds of metadata on a real vocabulary). A manifest without the
    record (older conversions) still means a read."""
    from test_models import write_tiny_llama_gguf

    from dartspec.models import resolve_model
    from dartspec.targets import load_target

    path = tmp_path / "tiny-f32.gguf"
    write_tiny_llama_gguf(path)
    monkeypatch.setenv("DARTSPEC_CACHE", str(tmp_path / "cache"))
    folder = resolve_model(str(path), cache=tmp_path / "cache", log=lambda _: None)
    manifest = json.loads((Path(folder) / MANIFEST_NAME).read_text())
    assert manifest["source"]["tensor_types"] == ["F32"] and kquants.holds_no_groups(folder)
    monkeypatch.setattr(kquants, "file_groups", lambda *a: pytest.fail("read a GGUF that holds no groups"))
    target = load_target(str(folder))  # the CPU default: exact-a16 where the file gives groups
    assert describe(target).startswith("lean/")
    assert target.score_sequence(list(range(3, 20))).logits.isfinite().all()
    del manifest["source"]["tensor_types"]
    (Path(folder) / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert not kquants.holds_no_groups(folder) and not kquants.holds_no_groups(None)


def test_source_gguf_is_none_without_the_file(tmp_path) -> None:
    folder = tmp_path / "converted"
    folder.mkdir()
    assert kquants.source_gguf(folder) is None  # no manifest
    (folder / MANIFEST_NAME).write_text(json.dumps({"source": {"file": "x.gguf", "path": str(tmp_path / "x.gguf")}}))
    assert kquants.source_gguf(folder) is None  # the file is gone
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    assert kquants.source_gguf(folder) is None  # another file than the one converted (its size differs)


@pytest.mark.skipif(not exact.available(), reason="needs gcc and an AVX2 CPU")
def test_a_q4_k_m_style_llama_gguf_runs_as_exact_a16_and_agrees_with_transformers(tmp_path, monkeypatch) -> None:
    """A Llama GGUF of K-quant blocks as a Q4_K_M file has them (every projection Q4_K, one value projection, the down
    projections, the embedding and the head Q6_K; a few Q5_K, as a Q5_K_M file's), converted by transformers as a
    user's file is: its query and key rows come back reordered (the file keeps rotary's other layout), fused
    projections take their parts' groups, the one whose parts are of two kinds (Q4_K query and key, Q6_K value) as a
    chain of both. Logits agree with transformers' own fp32 forward of the converted model, and are the same bit for
    bit from the packed-weight cache; a tree row equals that token decoded alone."""
    from test_models import write_tiny_llama_gguf

    from dartspec.models import resolve_model
    from dartspec.targets import load_target

    # Weights of about a trained model's size: a random network of large ones is chaotic (a 16-bit rounding of an
    # activation moves its logits by a tenth of their range), which would test nothing.
    def q4_k(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, object]:
        return random_q4_k(rng, rows, cols, scale=0.1), gguf.GGMLQuantizationType.Q4_K

    def q5_k(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, object]:
        return random_q5_k(rng, rows, cols, scale=0.1), gguf.GGMLQuantizationType.Q5_K

    def q6_k(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, object]:
        return random_q6_k(rng, rows, cols, scale=0.2), gguf.GGMLQuantizationType.Q6_K

    blocks = {"token_embd.weight": q6_k, "output.weight": q6_k}
    for i in range(2):
        blocks |= {f"blk.{i}.{n}.weight": q4_k for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")}
        blocks |= {f"blk.{i}.attn_v.weight": q6_k if i == 0 else q4_k, f"blk.{i}.ffn_down.weight": q6_k}
    blocks |= {"blk.1.ffn_gate.weight": q5_k, "blk.1.ffn_up.weight": q5_k, "blk.0.attn_output.weight": q5_k}
    path = tmp_path / "tiny-kquants.gguf"
    write_tiny_llama_gguf(path, hidden=256, inter=512, heads=4, kv_heads=2, blocks=blocks)
    monkeypatch.setenv("DARTSPEC_CACHE", str(tmp_path / "cache"))
    folder = resolve_model(str(path), cache=tmp_path / "cache", log=lambda _: None)
    assert kquants.source_gguf(folder) == path.resolve()
    recorded = json.loads((Path(folder) / MANIFEST_NAME).read_text())["source"]["tensor_types"]
    assert {"Q4_K", "Q5_K", "Q6_K", "F32"} <= set(recorded) and not kquants.holds_no_groups(folder)

    target = load_target(str(folder))
    kinds = {name: (lin.fmt, lin.packed.kind) for name, lin in target._linears().items()}
    assert kinds["head"] == ("exact-a16", 6)
    qkv = target._linears()["layers.0.qkv"].packed
    assert [(p.kind, p.out_features) for p in exact.parts(qkv)] == [(4, 256 + 128), (6, 128)]
    assert kinds["layers.0.qkv"] == ("exact-a16", 4) and kinds["layers.1.qkv"] == ("exact-a16", 4)
    assert kinds["layers.0.o"] == ("exact-a16", 5) and kinds["layers.1.o"] == ("exact-a16", 4)
    assert kinds["layers.0.gate_up"] == ("exact-a16", 4) and kinds["layers.1.gate_up"] == ("exact-a16", 5)
    assert kinds["layers.0.down"] == kinds["layers.1.down"] == ("exact-a16", 6)
    reference = load_target(str(folder), runtime="hf")
    ids = list(range(3, 60))
    got, want = target.score_sequence(ids).logits, reference.score_sequence(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # logits of about 1; fp16 weights: 2e-4 off
    assert_tree_rows_decode_alone(target, ids[:12], seed=3)
    cached = load_target(str(folder))  # from the packed-weight cache, chain and all
    assert [(p.kind, p.out_features) for p in exact.parts(cached._linears()["layers.0.qkv"].packed)] == [
        (4, 384),
        (6, 128),
    ]
    assert torch.equal(cached.score_sequence(ids).logits, got)


def test_a_damaged_source_gguf_only_costs_speed(tmp_path) -> None:
    """Groups are an optional reading of a file the model was converted from: a damaged file is a warning and fp16
    weights, never a failed load."""
    from dartspec.lean import _file_groups
    from dartspec.lean_weights import LeanWeights

    model = _tiny_qwen2()
    folder = tmp_path / "converted"
    model.save_pretrained(folder)
    path = tmp_path / "damaged.gguf"
    path.write_bytes(b"not a gguf file at all")
    source = {"file": path.name, "path": str(path), "size": path.stat().st_size}
    (folder / MANIFEST_NAME).write_text(json.dumps({"source": source}))
    model.config._name_or_path = str(folder)
    with pytest.warns(UserWarning, match="could not read integer groups"):
        assert _file_groups(LeanWeights.from_model(model), "exact-a16") == {}
