"""The batched generator and the trainer wait for the device only where they must (see tests/host_reads.py).

The first GPU window measured both far below their goals with the device mostly idle: ~80 ms a decode step for a
135M model, 0.35-0.40 s a training step. These tests count, on a CPU, the reads and blocking copies that would hold a
GPU's host: the generator reads its new tokens once every ``check_every`` steps and nothing else; a training step
reads its loss and gradient norm once, at its end, after the host has queued the whole step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import tiny_model, tiny_target, tiny_tokenizer
from host_reads import HostReads
from test_batch_decode import prompts, runtime
from test_dart import random_samples, small_config

from dartspec.batch_decode import decode_batch
from dartspec.lean import LeanTarget
from dartspec.train.dart import DartTrainer


@pytest.mark.parametrize("kind", ["lean", "hf"])
@pytest.mark.parametrize("every", [1, 8])
def test_the_generator_reads_once_every_check(kind: str, every: int) -> None:
    target = runtime(kind, "llama")
    batch = prompts(9)
    steps = 40
    with HostReads() as reads:
        decode_batch(target, batch, steps, stop_ids=frozenset(), check_every=every)
    assert reads.sites == {("tolist", "batch_decode.py:decode_batch"): math.ceil(steps / every)}, reads.sites


def packed_trainer(target: object, tmp_path: Path, kind: str = "dart") -> DartTrainer:
    """A trainer of ``kind`` whose steps are one packed forward of 8 sequences (as on a GPU), built."""
    from dartspec.train.eagle3 import Eagle3Trainer

    cls = Eagle3Trainer if kind == "eagle3" else DartTrainer
    cfg = small_config(seqs_per_step=8, pack=8, anchors_per_seq=16, depth=6, length_sort_steps=1)
    trainer = cls(target, random_samples(32, 0, (24, 80)), [], tmp_path, cfg, log=lambda m: None)
    trainer.build()
    return trainer


@pytest.mark.parametrize("kind", ["dart", "eagle3"])
def test_a_training_step_reads_the_device_once(tmp_path: Path, kind: str) -> None:
    """A packed step on the lean forward scoring the batch in one pass (as on a GPU): one read, at the end. The
    per-depth figures, which only evaluation prints, stay on the device; EAGLE-3's per-sequence unrolling too."""
    target = LeanTarget(tiny_model("llama"), tiny_tokenizer(), name="lean")
    target.batch_scoring = True  # what a GPU does (the CPU scores sequence by sequence, which is faster there)
    trainer = packed_trainer(target, tmp_path, kind)
    trainer.train_step()
    with HostReads() as reads:
        metrics = trainer.train_step()
    assert list(reads.sites) == [("tolist", "train/dart.py:train_step")], reads.sites
    assert reads.count == 1 and math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


def test_transformers_modules_add_only_their_own_check_before_the_first_layer(tmp_path: Path) -> None:
    """On transformers' modules a step has one more read: transformers checks the positions for packed sequences
    before its first layer runs, when the device has nothing queued but the embedding (so it costs no idle time)."""
    trainer = packed_trainer(tiny_target(fast_linear=False), tmp_path)
    with HostReads() as reads:
        trainer.train_step()
    want = {("__bool__", "target.py:score_batch"): 1, ("tolist", "train/dart.py:train_step"): 1}
    assert reads.sites == want, reads.sites
