"""``--drafter auto`` measured on the machine (dartspec.tune): the rule, the cache, and the real measurement."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import tiny_target

from dartspec.errors import DartspecError


@pytest.mark.parametrize(
    ("speedups", "mismatches", "chosen"),
    [
        ({"dart+pld": 1.16, "pld": 1.07}, {}, "dart+pld"),
        ({"dart+pld": 0.97, "pld": 1.06}, {}, "pld"),
        ({"dart+pld": 0.97, "pld": 0.99}, {}, "none"),  # neither beats plain decoding
        ({"dart+pld": 1.0, "pld": 1.0}, {}, "none"),  # a tie with plain decoding is plain decoding
        ({"dart+pld": 1.2, "pld": 1.1}, {"dart+pld": 1}, "pld"),  # output that differed is never chosen
        ({"dart+pld": float("nan"), "pld": 1.05}, {}, "pld"),
        ({"dart+pld": 1.1, "pld": 1.1}, {}, "dart+pld"),  # a tie goes to the first listed
    ],
)
def test_choose_takes_the_fastest_that_beats_plain_decoding(
    speedups: dict[str, float], mismatches: dict[str, int], chosen: str
) -> None:
    from dartspec.tune import choose

    assert choose(speedups, mismatches) == chosen


def test_candidates_are_measured_only_where_a_dart_drafter_ships() -> None:
    import torch

    from dartspec.tune import candidates

    target = tiny_target()
    assert candidates(target) == ("pld",)
    assert candidates(SimpleNamespace(device=torch.device("cpu"), name="smollm2-135m")) == ("dart+pld", "pld")
    assert candidates(SimpleNamespace(device=torch.device("cuda"), name="smollm2-135m")) == ("none",)


def test_auto_drafter_measures_once_then_reads_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dartspec.tune as tune

    target = tiny_target()
    calls: list[tuple[str, ...]] = []

    def fake_measure(target, drafters, *, path=None, **kw):
        calls.append(tuple(drafters))
        return tune.Tuned("pld", {"dart+pld": 0.97, "pld": 1.06}, {"dart+pld": 0, "pld": 0}, 16, 48, "today"), []

    monkeypatch.setattr(tune, "candidates", lambda t: ("dart+pld", "pld"))
    monkeypatch.setattr(tune, "measure", fake_measure)
    monkeypatch.setattr(tune, "others_busy", lambda: 0.0)  # an idle machine (the suite's own load aside)
    logged: list[str] = []
    assert tune.auto_drafter(target, cache=tmp_path, log=logged.append) == "pld"
    assert calls == [("dart+pld", "pld")] and len(logged) == 2 and "pld 1.06x" in logged[1]
    file = tune.tuned_file(target, cache=tmp_path)
    assert json.loads(file.read_text())["drafter"] == "pld"
    assert tune.auto_drafter(target, cache=tmp_path, log=logged.append) == "pld"
    assert len(calls) == 1 and len(logged) == 2  # read back, not measured again
    file.write_text("{broken")
    assert tune.auto_drafter(target, cache=tmp_path, log=logged.append) == "pld" and len(calls) == 2
    # Another drafter checkpoint is another choice.
    other = tmp_path / "ckpt"
    other.mkdir()
    (other / "config.json").write_text("{}")
    assert tune.tuned_file(target, other, tmp_path) != file
    tune.auto_drafter(target, other, cache=tmp_path, log=logged.append)
    assert len(calls) == 3
    # A stored choice is used where nothing would be measured (`dartspec tune` on a one-candidate model).
    monkeypatch.setattr(tune, "candidates", lambda t: ("pld",))
    tune.save_tuned(file, tune.Tuned("none", {"pld": 0.98}, {"pld": 0}, 16, 48, "today"))
    assert tune.auto_drafter(target, cache=tmp_path) == "none" and len(calls) == 3
    file.unlink()
    assert tune.auto_drafter(target, cache=tmp_path) == "pld" and len(calls) == 3


def test_a_choice_measured_beside_busy_processes_is_used_but_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dartspec.tune as tune

    target = tiny_target()
    tuned = tune.Tuned("dart+pld", {"dart+pld": 1.19, "pld": 0.93}, {"dart+pld": 0, "pld": 0}, 16, 48, "today")
    monkeypatch.setattr(tune, "candidates", lambda t: ("dart+pld", "pld"))
    monkeypatch.setattr(tune, "measure", lambda *a, **k: (tuned, []))
    monkeypatch.setattr(tune, "others_busy", lambda: 0.9)
    logged: list[str] = []
    assert tune.auto_drafter(target, cache=tmp_path, log=logged.append) == "dart+pld"
    assert "using 90% of the CPUs" in logged[1] and "not kept" in logged[1]
    assert not tune.tuned_file(target, cache=tmp_path).exists()  # the next auto measures again
    monkeypatch.setattr(tune, "others_busy", lambda: 0.1)
    tune.auto_drafter(target, cache=tmp_path, log=logged.append)
    assert tune.tuned_file(target, cache=tmp_path).exists()


def test_others_busy_sees_a_process_that_spins() -> None:
    """The share of CPU time other processes take (/proc/stat): one spinning process is at least a core's share."""
    import os
    import subprocess
    import sys

    from dartspec.tune import others_busy

    if not Path("/proc/stat").exists():
        pytest.skip("needs Linux's /proc/stat")
    cores = os.cpu_count() or 1
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        share = others_busy(1.0)
    finally:
        spin.kill()
        spin.wait()
    assert share is not None and share >= 0.8 / cores


def test_auto_in_the_front_ends_runs_the_stored_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dartspec.drafters import make_drafter
    from dartspec.methods import GeneratorSpec, build_generator
    from dartspec.tune import Tuned, save_tuned, tuned_file

    monkeypatch.setenv("DARTSPEC_CACHE", str(tmp_path))
    target = tiny_target()
    assert build_generator(target, GeneratorSpec(drafter="auto")).drafter.name == "pld"  # nothing stored
    save_tuned(tuned_file(target), Tuned("none", {"pld": 0.95}, {"pld": 0}, 16, 48, "today"))
    assert build_generator(target, GeneratorSpec(drafter="auto")).drafter.name == "none"
    assert make_drafter("auto", target).name == "none"


def test_measure_runs_the_benchmark_rows_on_the_tuning_prompts() -> None:
    from dartspec.tune import TUNE_PROMPTS, choose, measure

    assert len(TUNE_PROMPTS.read_text().splitlines()) >= 16
    target = tiny_target()
    tuned, rows = measure(target, ["none", "pld"], prompts=2, new_tokens=6)
    assert [r["method"] for r in rows] == ["ar", "pld"] and all(r["prompts"] == 2 for r in rows)
    assert tuned.prompts == 2 and tuned.new_tokens == 6 and tuned.mismatches == {"pld": 0}
    assert tuned.speedups == {"pld": round(rows[1]["speedup"], 3)}
    assert tuned.drafter == choose(tuned.speedups, tuned.mismatches)
    with pytest.raises(DartspecError, match="nothing to measure"):
        measure(target, ["none"])
