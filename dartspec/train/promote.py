"""``dartspec train promote``: a trained drafter replaces the installed one only when it is better on dev.

Training continues in many places (GPU windows, CPU background runs), and a run can end worse than it started
(a bad learning rate, too few steps after a warm start). So a checkpoint is never copied over the shipped one by
hand: both are scored on the same dev answers with the same seed (teacher-forced top-1 per depth, the
full-vocabulary rule of :mod:`dartspec.train.evaluate`), and the candidate goes in only if its depth-1 top-1 is
higher and its chain tau estimate is not lower. The installed folder is replaced whole (a finished copy renamed into
place, keeping the files the candidate lacks, such as the n-gram model and the model card), matrices in int8 with a
scale per row, and every decision is appended to its ``promotions.jsonl``. The candidate is stored in that format once,
and those files are both what the gate scores and what it installs: it judges the drafter that would ship, not its
fp32 export.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dartspec.errors import DartspecError
from dartspec.model_cache import swap_into_place
from dartspec.train.evaluate import DepthAccuracy, depth_accuracies, load_drafter_model, model_objective

#: Files of a checkpoint folder that carry the network; everything else in the installed folder is kept.
_NETWORK_FILES = ("config.json", "model.safetensors")


def score(
    target: Any, kind: str, folders: Sequence[Path], samples: Sequence[tuple[np.ndarray, int]], anchors: int
) -> list[DepthAccuracy]:
    """The drafters in ``folders``, scored on the same samples: those that read the same feature layers on one
    target pass (the target's forward is most of a CPU's time here), the others each on its own."""
    models = [load_drafter_model(kind, target, str(folder)) for folder in folders]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, model in enumerate(models):
        groups.setdefault(tuple(model.cfg.feature_layers), []).append(i)
    scores: dict[int, DepthAccuracy] = {}
    for layers, members in groups.items():
        target.set_feature_layers(list(layers))
        got = depth_accuracies(
            target,
            samples,
            [model_objective(models[i], anchors=anchors) for i in members],
            depths=[models[i].cfg.depth for i in members],
        )
        scores |= dict(zip(members, got, strict=True))
    return [scores[i] for i in range(len(models))]


def replayed_taus(
    target: Any, folders: Sequence[Path], samples: Sequence[tuple[np.ndarray, int]], nodes: int
) -> list[float]:
    """Median tau of the DART drafters in ``folders`` replayed on ``samples`` (:mod:`dartspec.bench.replay`): the
    beam search at ``nodes`` nodes, without the n-gram (the same table serves both), as each would decode the stored
    answers. What the gate's teacher-forced figures estimate, measured on the tree."""
    from dartspec.bench.replay import ReplayEntry, replay_samples
    from dartspec.drafters.dart import DartDrafter
    from dartspec.methods import GeneratorSpec

    depth = GeneratorSpec().max_depth  # the engine's default draft depth
    entries = [
        ReplayEntry(str(f), DartDrafter.from_pretrained(f, target, "beam", fast_step=False), nodes, depth, str(i))
        for i, f in enumerate(folders)
    ]
    return [replay.tau for replay in replay_samples(target, entries, samples)]


def store_as_shipped(kind: str, target: Any, candidate: Path, folder: Path) -> None:
    """Write ``candidate``'s network into ``folder`` as the shipped drafters store it (int8 matrices, a scale per
    row): the gate scores these files and installs them, so what it judged is what ships (the rounding moves dev
    top-1 in the fourth decimal, as much as a CPU training step can gain)."""
    load_drafter_model(kind, target, str(candidate)).save(folder, int8=True)


def is_better(candidate: DepthAccuracy, installed: DepthAccuracy) -> bool:
    """Higher depth-1 top-1 and a chain tau estimate at least as high."""
    return candidate.top1[0] > installed.top1[0] and candidate.chain_tau_est >= installed.chain_tau_est


def install(shipped: Path, candidate: Path, into: Path) -> None:
    """Replace the network in ``into`` by the files in ``shipped`` (:func:`store_as_shipped`), keeping ``into``'s
    other files and adding ``candidate``'s training log; the folder at ``into`` is always complete (a finished copy
    is renamed into place)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{into.name}.tmp-", dir=into.parent))
    try:
        for item in into.iterdir():
            if item.name not in _NETWORK_FILES and item.is_file():
                shutil.copy2(item, tmp / item.name)
        for name in _NETWORK_FILES:
            shutil.copy2(shipped / name, tmp / name)
        log = candidate / "train_log.jsonl"
        if log.is_file():  # beside the earlier logs, not over them
            shutil.copy2(log, tmp / f"train_log_{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        swap_into_place(tmp, into)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_checkpoint(folder: Path, what: str) -> None:
    """A clear error unless ``folder`` holds a drafter checkpoint (its config.json)."""
    if not (folder / "config.json").is_file():
        raise DartspecError(f"{folder} is not a drafter checkpoint (no config.json): the {what} is missing")


def promote(
    target: Any,
    candidate: Path,
    into: Path,
    samples: Sequence[tuple[np.ndarray, int]],
    *,
    kind: str = "dart",
    anchors: int = 256,
    replay: int = 0,
    replay_nodes: int = 16,
    dry_run: bool = False,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Score ``candidate`` and the drafter installed in ``into`` on ``samples``; install it if better. DART drafters
    are also replayed on the first ``replay`` answers at ``replay_nodes`` nodes (reported and recorded; the gate stays
    the teacher-forced figures, whose noise is lower)."""
    for folder, what in ((candidate, "candidate"), (into, "installed drafter")):
        check_checkpoint(folder, what)
    if candidate.resolve() == into.resolve():
        raise DartspecError("the candidate and the installed drafter are the same folder")
    if not samples:
        raise DartspecError("no dev samples to compare on")
    log(f"scoring the installed drafter ({into}) and the candidate ({candidate}) on {len(samples)} dev answers")
    with tempfile.TemporaryDirectory(prefix="dartspec-promote-") as tmp:
        shipped = Path(tmp)
        store_as_shipped(kind, target, candidate, shipped)
        installed, cand = score(target, kind, [into, shipped], samples, anchors)
        better = is_better(cand, installed)
        log(
            f"depth-1 top-1 {installed.top1[0]:.4f} -> {cand.top1[0]:.4f}, chain tau estimate "
            f"{installed.chain_tau_est:.3f} -> {cand.chain_tau_est:.3f}: {'better' if better else 'not better'}"
        )
        taus: list[float] = []
        answers = min(replay, len(samples))
        if answers and kind == "dart":
            taus = replayed_taus(target, [into, shipped], samples[:answers], replay_nodes)
            log(f"replayed tau at {replay_nodes} nodes on {answers} answers {taus[0]:.3f} -> {taus[1]:.3f}")
        if better and not dry_run:
            install(shipped, candidate, into)
            log(f"installed {candidate} into {into}")
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "candidate": str(candidate),
        "installed": installed.as_dict("installed_"),
        "candidate_scores": cand.as_dict("candidate_"),
        "dev_answers": len(samples),
        "promoted": better and not dry_run,
    }
    if taus:
        record["replayed_tau"] = {"nodes": replay_nodes, "answers": answers, "installed": taus[0], "candidate": taus[1]}
    if not dry_run:
        with open(into / "promotions.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return record
