"""Lean snapshots (:mod:`dartspec.lean_weights`): a second load of a folder builds the same runtime without
transformers' model code, and a snapshot that no longer describes the folder is never used."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, tiny_model, tiny_tokenizer
from test_lean import _gguf_like, _with_biases

from dartspec import lean_weights, weight_cache
from dartspec.engine import Generator
from dartspec.lean import LeanTarget
from dartspec.lean_weights import LeanWeights, load_model, read_snapshot, write_snapshot
from dartspec.target import Target
from dartspec.targets import load_target
from dartspec.tokenizer import LightTokenizer


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DARTSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _folder(tmp_path: Path, arch: str, *, gguf_like: bool = False, untied: bool = False) -> Path:
    model = _with_biases(tiny_model(arch, seed=5).float(), 5)
    if untied:  # a head of its own: saved under its own name
        import transformers as tf

        config = tf.LlamaConfig(**{**model.config.to_dict(), "tie_word_embeddings": False})
        torch.manual_seed(6)
        model = tf.LlamaForCausalLM(config).float().eval()
    if gguf_like:
        model = _gguf_like(model)
    folder = tmp_path / f"tiny-{arch}"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _ids() -> torch.Tensor:
    return torch.randint(2, VOCAB, (30,), generator=torch.Generator().manual_seed(1))


def _assert_same_runtime(fast: LeanTarget, slow: LeanTarget) -> None:
    ids = _ids()
    a, b = fast.score_sequence(ids), slow.score_sequence(ids)
    assert torch.equal(a.logits, b.logits)
    assert torch.equal(a.features, b.features)
    assert (fast.weight_format, fast.eos_token_ids, fast.max_context) == (
        slow.weight_format,
        slow.eos_token_ids,
        slow.max_context,
    )
    assert torch.equal(fast.lm_head_weight(), slow.lm_head_weight())
    plain = [Generator(t).generate(ids[:8].tolist(), max_new_tokens=12).token_ids for t in (fast, slow)]
    assert plain[0] == plain[1]
    # The config reads back with every attribute transformers' had
    want = json.loads(slow.config.to_json_string(use_diff=False))
    assert {k: getattr(fast.config, k) for k in want} == want


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_a_second_load_reads_the_snapshot_and_builds_the_same_runtime(tmp_path: Path, cache: Path, arch: str) -> None:
    folder = _folder(tmp_path, arch)
    slow = load_target(str(folder))
    assert isinstance(slow, LeanTarget) and slow._model is not None
    assert len(list((cache / "lean").glob("*.json"))) == 1
    fast = load_target(str(folder))
    assert isinstance(fast, LeanTarget) and fast._model is None  # no transformers model was built
    _assert_same_runtime(fast, slow)
    assert isinstance(fast.tokenizer, LightTokenizer)  # read without transformers (dartspec.tokenizer)
    assert fast.tokenizer("t5 t9 t3")["input_ids"] == slow.tokenizer("t5 t9 t3")["input_ids"]
    assert fast.decode([5, 9, 1, 3]) == slow.decode([5, 9, 1, 3])
    # The transformers model, loaded when asked for, is the one the slow load had
    with torch.no_grad():
        assert torch.equal(fast.model(_ids()[None]).logits, slow.model(_ids()[None]).logits)


def test_an_untied_head_is_read_from_its_own_tensor(tmp_path: Path, cache: Path) -> None:
    folder = _folder(tmp_path, "llama", untied=True)
    slow = load_target(str(folder))
    assert not torch.equal(slow.lm_head_weight(), slow._embed)
    fast = load_target(str(folder))
    assert fast._model is None
    _assert_same_runtime(fast, slow)


def test_a_snapshot_reuses_the_packed_weight_cache(tmp_path: Path, cache: Path) -> None:
    folder = _folder(tmp_path, "qwen3", gguf_like=True)
    slow = load_target(str(folder))
    assert slow.weight_format == "exact-a16" and slow.packed_cache is not None
    fast = load_target(str(folder))
    assert fast._model is None and fast.packed_cache is not None
    assert fast.packed_cache.path == slow.packed_cache.path
    _assert_same_runtime(fast, slow)


def test_a_changed_file_or_a_damaged_snapshot_means_a_full_load(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _folder(tmp_path, "llama")
    ref = load_target(str(folder))
    assert read_snapshot(folder, "exact-a16") is not None
    with monkeypatch.context() as m:  # another transformers may read the folder otherwise
        m.setattr(lean_weights, "_transformers_version", lambda: "0.0")
        assert read_snapshot(folder, "exact-a16") is None
    with monkeypatch.context() as m:  # a new packed layout: the recorded packed-weight cache is another version's
        m.setattr(weight_cache, "PACKED_VERSION", weight_cache.PACKED_VERSION + 1)
        assert read_snapshot(folder, "exact-a16") is None
    config = folder / "config.json"
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # edited in place
    assert read_snapshot(folder, "exact-a16") is None
    again = load_target(str(folder))
    assert again._model is not None  # the slow way, which writes a new snapshot
    assert load_target(str(folder))._model is None
    (snapshot,) = (cache / "lean").glob("*.json")
    snapshot.write_text('{"version": 1, "folder": ')
    with pytest.warns(UserWarning, match="ignoring the lean runtime's snapshot"):
        damaged = load_target(str(folder))
    assert damaged._model is not None
    _assert_same_runtime(load_target(str(folder)), ref)


def test_no_snapshot_of_weights_that_differ_from_the_files(tmp_path: Path, cache: Path) -> None:
    folder = _folder(tmp_path, "llama")
    model = load_model(folder, dtype=torch.float32, device=torch.device("cpu"))
    target = LeanTarget(model, tiny_tokenizer())
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # what a conversion while loading would look like
    assert write_snapshot(target, LeanWeights.from_model(model), tiny_tokenizer(), "exact-a16") is None
    assert not (cache / "lean").exists()


def test_only_the_cpu_default_loads_from_a_snapshot(tmp_path: Path, cache: Path) -> None:
    folder = _folder(tmp_path, "llama")
    load_target(str(folder))
    assert load_target(str(folder), quant="fp16")._model is not None
    assert isinstance(load_target(str(folder), runtime="hf"), Target)
    assert load_target(str(folder), dtype=torch.float64)._model is not None


def test_a_load_from_a_snapshot_never_imports_transformers(tmp_path: Path, cache: Path) -> None:
    """What makes it fast (importing transformers alone takes ~1 s on 2 cores): checked in a fresh process, which
    generates and reads the vocabulary; asking for the transformers model then imports it."""
    import subprocess
    import sys

    folder = _folder(tmp_path, "qwen2")
    slow = load_target(str(folder))
    want = Generator(slow).generate(_ids()[:8].tolist(), max_new_tokens=6).token_ids
    code = f"""
import sys
from dartspec.engine import Generator
from dartspec.targets import load_target
t = load_target({str(folder)!r})
got = Generator(t).generate({_ids()[:8].tolist()}, max_new_tokens=6).token_ids
print(got, t.decode(got) == {slow.decode(want)!r}, len(t.vocab), t._model is None, "transformers" in sys.modules)
t.model
print("transformers" in sys.modules)
"""
    env = {**os.environ, "DARTSPEC_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split("\n")[:2] == [f"{want} True {len(slow.vocab)} True False", "True"]
