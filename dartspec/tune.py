"""What ``--drafter auto`` means for a model on this machine: the fastest candidate, measured once and cached.

Which drafter pays on a CPU depends on the CPU, not only on the model (BENCHMARKS.md). On a Zen 3 and on AVX-512
EPYCs DART with prompt-lookup spans (``dart+pld``) ran 1.12-1.31x plain decoding, 8-23 points ahead of prompt
lookup alone. On an Intel Xeon with AMX and 480 MB of L3, where SmolLM2's weights stay in the cache and a one-token
step is short, each verified row and DART's own forward weigh more: there prompt lookup alone led the hybrid by 6-9
points on every set and the hybrid ran below plain decoding on chat. No static rule told the two apart from what a
program can read off the machine, so where more than one drafter could be the default (a DART drafter ships for the
model), the first ``auto`` on a machine times them: the benchmark's own rows (:func:`dartspec.bench.suite.run_suite`:
plain decoding and each candidate on the same prompts, rotating order, after a warm-up, outputs checked against
plain decoding's) on a few development prompts shipped with the package (ShareGPT 14600-14634, first user turns),
and keeps the candidate with the best median speedup, or plain decoding where none beats it. The choice is cached
beside the verify cost curve, per machine, model, runtime, weight format, KV cache, thread count, kernel build and
drafter checkpoint; ``dartspec tune`` measures it again.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dartspec import atomic
from dartspec.drafters import default_drafter, shipped_checkpoint
from dartspec.errors import DartspecError

#: The development prompts the choice is measured on (first user turns of ShareGPT 14600-14634, 40-600 characters).
TUNE_PROMPTS = Path(__file__).with_name("tune_prompts.jsonl")
#: Prompts and new tokens a measurement takes by default: on a 2-core CPU ~10 s for SmolLM2 (three rows).
DEFAULT_PROMPTS = 16
DEFAULT_NEW_TOKENS = 48
#: The share of the machine's CPU time other processes may take just before a measurement for it to count: above it
#: the timings are theirs as much as the drafters' (a first `auto` beside a 2-thread job on 2 cores chose dart+pld at
#: 1.19x where every idle measurement chose pld, and the default then ran at 0.99x plain decoding on MT-Bench).
BUSY_SHARE = 0.25


@dataclass(frozen=True)
class Tuned:
    """A measured choice: the drafter ``auto`` runs, and each candidate's median speedup over plain decoding."""

    drafter: str
    speedups: dict[str, float]
    mismatches: dict[str, int]
    prompts: int
    new_tokens: int
    measured: str  # the date, ISO

    def summary(self) -> str:
        rows = ", ".join(f"{name} {speed:.2f}x" for name, speed in self.speedups.items())
        return f"{self.drafter} ({rows} plain decoding; {self.prompts} prompts, {self.measured})"


def candidates(target: Any) -> tuple[str, ...]:
    """The drafters ``auto`` chooses among for ``target`` without being asked to measure: the device's static
    default, and prompt lookup beside DART's hybrid where that is the default (a DART drafter ships)."""
    static = default_drafter(target.device, target.name)
    return ("dart+pld", "pld") if static == "dart+pld" else (static,)


def _checkpoint_key(target: Any, path: str | Path | None) -> str:
    """A short hash of the DART checkpoint the hybrid would load: a retrained drafter is measured again."""
    folder = Path(path) if path else shipped_checkpoint("dart", target.name)
    if folder is None or not folder.is_dir():
        return "none"
    digest = hashlib.sha256()
    for file in sorted(folder.iterdir()):
        if file.suffix in (".json", ".safetensors", ".bin") and file.is_file():
            digest.update(file.name.encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:12]


def tuned_file(target: Any, path: str | Path | None = None, cache: Path | None = None) -> Path:
    """Where ``target``'s choice on this machine is cached (beside its verify cost curve)."""
    from dartspec.assets import cache_dir
    from dartspec.tree_size import calibration_file

    return calibration_file(target, cache or cache_dir(), f"auto-{_checkpoint_key(target, path)}-t1")


def load_tuned(file: Path) -> Tuned | None:
    """The cached choice in ``file``, or None (none yet, or a damaged entry, which is removed)."""
    if not file.is_file():
        return None
    try:
        return Tuned(**json.loads(file.read_text()))
    except (ValueError, TypeError):
        file.unlink(missing_ok=True)
        return None


def measure(
    target: Any,
    drafters: Sequence[str],
    *,
    path: str | Path | None = None,
    prompts: int = DEFAULT_PROMPTS,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    progress: Callable[..., Any] | None = None,
) -> tuple[Tuned, list[dict[str, Any]]]:
    """Time ``drafters`` against plain decoding on the tuning prompts (greedy, interleaved); returns the choice and
    the benchmark's rows. A candidate whose output differs from plain decoding's is never chosen."""
    from dartspec.bench.report import summarize
    from dartspec.bench.suite import MethodSpec, load_prompts, run_suite

    drafters = [d for d in drafters if d != "none"]
    if not drafters:
        raise DartspecError("nothing to measure: plain decoding is the only candidate here")
    specs = [MethodSpec(d, d, path=str(path) if path and d in ("dart", "dart+pld") else None) for d in drafters]
    runs = run_suite(
        target, specs, load_prompts(str(TUNE_PROMPTS), limit=prompts), max_new_tokens=new_tokens, progress=progress
    )
    rows = summarize(runs)
    by_name = {r["method"]: r for r in rows}
    speedups = {d: round(float(by_name[d]["speedup"]), 3) for d in drafters}
    mismatches = {d: int(by_name[d]["mismatches"]) for d in drafters}
    today = datetime.date.today().isoformat()
    prompted = len({r.prompt for r in runs})
    return Tuned(choose(speedups, mismatches), speedups, mismatches, prompted, new_tokens, today), rows


def choose(speedups: dict[str, float], mismatches: dict[str, int]) -> str:
    """The candidate with the best median speedup over plain decoding, ``none`` where none beats it (NaN never
    does); one whose output differed from plain decoding's is never chosen. Ties go to the first listed."""
    best, best_speed = "none", 1.0
    for name, speed in speedups.items():
        if not mismatches.get(name) and speed > best_speed:
            best, best_speed = name, speed
    return best


def others_busy(seconds: float = 0.5) -> float | None:
    """The share of the machine's CPU time that other processes used over ``seconds`` while this one waits (Linux's
    /proc/stat; None where it cannot be read)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(ticks) - ticks[3] - ticks[4], sum(ticks)

    try:
        busy0, total0 = sample()
        time.sleep(seconds)
        busy1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (busy1 - busy0) / (total1 - total0) if total1 > total0 else None


def busy_warning() -> str | None:
    """Why a measurement now would not tell this machine's fastest drafter (others keep its CPUs busy), or None."""
    share = others_busy()
    if share is None or share <= BUSY_SHARE:
        return None
    return f"other processes are using {share:.0%} of the CPUs: the timings would be theirs as much as the drafters'"


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def auto_drafter(
    target: Any, path: str | Path | None = None, *, cache: Path | None = None, log: Callable[[str], None] = _stderr
) -> str:
    """The drafter ``--drafter auto`` runs for ``target`` here: a choice cached by ``dartspec tune`` or an earlier
    ``auto``, else the only candidate, else the fastest candidate measured now (once; it is then cached)."""
    file = tuned_file(target, path, cache)
    tuned = load_tuned(file)
    if tuned is not None:
        return tuned.drafter
    options = candidates(target)
    if len(options) == 1:
        return options[0]
    log(
        f"measuring which drafter is fastest for {target.name} on this machine: {', '.join(options)} and plain "
        f"decoding on {DEFAULT_PROMPTS} short prompts (once; cached; `dartspec tune` measures again)..."
    )
    busy = busy_warning()
    tuned, _ = measure(target, options, path=path)
    if busy is None:
        save_tuned(file, tuned)
    else:  # used now, measured again by the next `auto` (or `dartspec tune`) instead of kept
        log(f"warning: {busy}; this choice is not kept")
    log(f"--drafter auto is {tuned.summary()}")
    if any(tuned.mismatches.values()):
        log(f"warning: output differed from plain decoding: {tuned.mismatches} (please report it)")
    return tuned.drafter


def save_tuned(file: Path, tuned: Tuned) -> None:
    atomic.write_text(file, json.dumps(asdict(tuned), indent=1))
