"""`dartspec generate` from a cold process: another revision against this checkout, interleaved, both from their lean
snapshots.

Usage: python docs/bench/startup-tokenizer-2026-11-27/ab_light.py BASE_CHECKOUT [ROUNDS] [MODEL ...]

Each side runs with its own cache folder (its own lean snapshots; models, packed weights and kernels linked from the
shared cache), warmed once so that both load from a snapshot; then the two commands alternate, ROUNDS times a model.
Reports wall time of the whole process (medians), the ratio, and whether both printed the same text every time.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dartspec.assets import cache_dir

HERE = Path(__file__).resolve().parents[3]


def side(checkout: Path, root: Path) -> dict[str, str]:
    """Environment running ``checkout``'s dartspec with a cache of its own under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for entry in cache_dir().iterdir():
        if entry.name != "lean" and not (root / entry.name).exists():
            (root / entry.name).symlink_to(entry)
    return {**os.environ, "PYTHONPATH": str(checkout), "DARTSPEC_CACHE": str(root), "AB_CWD": str(root)}


def run(env: dict[str, str], model: str) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "dartspec.cli", "generate", "--model", model, "--max-new-tokens", "32"]
    start = time.perf_counter()
    out = subprocess.run(
        [*cmd, "--prompt", "Write a haiku about the sea."],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=env["AB_CWD"],
    )  # run outside any checkout: python puts the working folder before PYTHONPATH
    return time.perf_counter() - start, out.stdout


def main() -> None:
    base = Path(sys.argv[1]).resolve()
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    models = sys.argv[3:] or ["smollm2-135m"]
    tmp = Path(tempfile.mkdtemp(prefix="ab-light-"))
    envs = {"base": side(base, tmp / "base"), "new": side(HERE, tmp / "new")}
    for model in models:
        for env in envs.values():
            run(env, model)  # writes the side's snapshot
        times: dict[str, list[float]] = {k: [] for k in envs}
        texts: set[str] = set()
        for r in range(rounds):
            order = list(envs) if r % 2 == 0 else list(envs)[::-1]
            for k in order:
                t, text = run(envs[k], model)
                times[k].append(t)
                texts.add(text)
            print(f"{model} round {r}: " + ", ".join(f"{k} {times[k][-1]:.2f} s" for k in envs), flush=True)
        a, b = statistics.median(times["base"]), statistics.median(times["new"])
        print(f"{model}: median base {a:.2f} s, new {b:.2f} s ({a / b:.2f}x), same text: {len(texts) == 1}")


if __name__ == "__main__":
    main()
