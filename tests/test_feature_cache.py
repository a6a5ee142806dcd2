"""The training feature cache: a faithful fp16 round trip, crash-safe appends, refusal of another target."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_target
from test_dart import random_samples, small_config

from dartspec.bench.train_speed import parse_setting
from dartspec.errors import DartspecError
from dartspec.train.dart import DartTrainer
from dartspec.train.feature_cache import FeatureCache


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def seqs(seed: int = 0) -> list[list[int]]:
    return [s.tokens.tolist() for s in random_samples(3, seed)]


def test_round_trip_is_the_targets_values_in_fp16_and_persists(target, tmp_path: Path) -> None:
    batch = seqs()
    ref = target.score_batch(batch)
    cache = FeatureCache(target, tmp_path)
    first = cache.score_batch(batch)
    assert cache.misses == 3 and cache.hits == 0
    for i, s in enumerate(batch):
        n = len(s)
        want = ref.features[i, :n].to(torch.float16).to(ref.features.dtype)
        assert torch.equal(first.features[i, :n], want)
        hidden = ref.hidden[i, :n].to(torch.float16).to(ref.hidden.dtype)
        assert torch.equal(first.logits[i, :n], target.logits(hidden))
        assert torch.allclose(first.logits[i, :n], ref.logits[i, :n], atol=2e-2)
    again = FeatureCache(target, tmp_path).score_batch(list(reversed(batch)))
    for i, j in enumerate(reversed(range(3))):
        n = len(batch[j])
        assert torch.equal(again.features[i, :n], first.features[j, :n])
        assert torch.equal(again.logits[i, :n], first.logits[j, :n])


def test_torn_appends_are_ignored_and_recomputed(target, tmp_path: Path) -> None:
    batch = seqs()
    cache = FeatureCache(target, tmp_path)
    first = cache.score_batch(batch[:2])
    # Crashes mid-append: rows no line names, a line naming rows that never reached the disk, a torn last line.
    with open(tmp_path / "rows.f16", "ab") as f:
        f.write(b"\x00" * 1000)
    with open(tmp_path / "index.tsv", "a") as f:
        f.write("abc\t99999\t8\nhalf\t12")
    reopened = FeatureCache(target, tmp_path)
    assert len(reopened) == 2
    out = reopened.score_batch(batch)
    assert reopened.misses == 1 and reopened.hits == 2
    n = len(batch[0])
    assert torch.equal(out.logits[0, :n], first.logits[0, :n])
    assert len(FeatureCache(target, tmp_path)) == 3  # the line written after the torn one is read back


def test_a_cache_of_another_target_or_layers_is_refused(target, tmp_path: Path) -> None:
    FeatureCache(target, tmp_path).score_batch(seqs()[:1])
    with pytest.raises(DartspecError, match="another target"):
        FeatureCache(tiny_target("llama", seed=5), tmp_path)
    other = tiny_target("llama")
    other.set_feature_layers([1, 2, 3])
    with pytest.raises(DartspecError, match="another target or feature layers"):
        FeatureCache(other, tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(DartspecError, match="damaged"):
        FeatureCache(target, tmp_path)


def test_training_with_the_cache_skips_the_target_after_the_first_epoch(target, tmp_path: Path) -> None:
    train = random_samples(8, 0)
    cfg = small_config(max_steps=8, seqs_per_step=2, feature_cache=str(tmp_path / "cache"))
    cached = DartTrainer(target, train, [], tmp_path / "a", cfg, log=lambda m: None)
    cached.fit()
    scorer = cached.scorer()
    assert scorer.misses == 8 and scorer.hits == 8  # two epochs of 8 samples: the second from disk
    online = DartTrainer(target, train, [], tmp_path / "b", small_config(max_steps=8, seqs_per_step=2), log=print)
    online.fit()
    log_a = [json.loads(x)["loss"] for x in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    log_b = [json.loads(x)["loss"] for x in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(log_a, log_b, rtol=1e-3)  # fp16-rounded inputs, the same learning


def test_bench_setting() -> None:
    assert parse_setting("pack=1,cache=1") == {"pack": 1, "feature_cache": True}
    with pytest.raises(ValueError):
        parse_setting("cache=yes")
