"""``train promote``: a trained drafter replaces the installed one only when it scores better on dev."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_target
from test_dart import random_samples, small_config

from dartspec.drafters.dart_model import DartModel, stored_tensors, unpack_int8
from dartspec.errors import DartspecError
from dartspec.train.dart import DartTrainer
from dartspec.train.promote import promote, score


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path, Path, list]:
    """A tiny target, a barely trained drafter (1 step) and a trained one (30 steps), and dev samples."""
    target = tiny_target()
    root = tmp_path_factory.mktemp("promote")
    train, dev = random_samples(16, 0), random_samples(6, 1)
    for name, steps in (("weak", 1), ("strong", 30)):
        DartTrainer(target, train, dev, root / name, small_config(max_steps=steps), log=lambda m: None).fit()
    return target, root / "weak", root / "strong", [(s.tokens, s.prompt_len) for s in dev]


def installed_copy(src: Path, dest: Path) -> Path:
    DartModel.load(src).save(dest)
    (dest / "ngram.bin").write_bytes(b"kept")
    (dest / "README.md").write_text("model card")
    return dest


def test_a_better_drafter_is_installed_and_a_worse_one_is_not(trained, tmp_path: Path) -> None:
    target, weak, strong, dev = trained
    into = installed_copy(weak, tmp_path / "shipped")
    messages: list[str] = []
    record = promote(target, strong, into, dev, log=messages.append)
    assert record["promoted"]
    got, want = DartModel.load(into), DartModel.load(strong)
    stored = unpack_int8(stored_tensors(want.state_dict(), int8=True))
    for name, a in got.state_dict().items():
        b = stored[name]
        assert torch.equal(a, b.to(a.dtype)), name  # the candidate's weights, stored as shipped (int8 matrices)
    assert (into / "ngram.bin").read_bytes() == b"kept" and (into / "README.md").read_text() == "model card"
    # The gate judged what now ships: the installed folder scores exactly what the candidate's record says.
    rescored = score(target, "dart", [into], dev, 256)[0].as_dict(
        "candidate_"
    )  # alone, as the gate scored it beside the installed one
    assert rescored == record["candidate_scores"]
    assert list(into.glob("train_log_*.jsonl"))
    # The weak one now loses against what is installed: nothing changes but the record.
    before = (into / "model.safetensors").read_bytes()
    record = promote(target, weak, into, dev, log=messages.append)
    assert not record["promoted"] and (into / "model.safetensors").read_bytes() == before
    lines = [json.loads(x) for x in (into / "promotions.jsonl").read_text().splitlines()]
    assert [x["promoted"] for x in lines] == [True, False]
    assert not list(tmp_path.glob(".shipped.*"))  # no temporary folder left behind


def test_dry_run_changes_nothing_and_bad_folders_are_named(trained, tmp_path: Path) -> None:
    target, weak, strong, dev = trained
    into = installed_copy(weak, tmp_path / "shipped")
    before = sorted(p.name for p in into.iterdir())
    assert not promote(target, strong, into, dev, dry_run=True, log=lambda m: None)["promoted"]
    assert sorted(p.name for p in into.iterdir()) == before
    with pytest.raises(DartspecError, match="candidate is missing"):
        promote(target, tmp_path / "nowhere", into, dev, log=lambda m: None)
    with pytest.raises(DartspecError, match="same folder"):
        promote(target, into, into, dev, log=lambda m: None)
