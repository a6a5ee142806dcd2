"""`dartspec generate` from a cold process, with and without the lean snapshot, interleaved.

Usage: python docs/bench/startup-2026-11-27/ab_startup.py [ROUNDS] [MODEL]

Each round deletes the model's lean snapshot, runs the command (a full load, which writes the snapshot again), then
runs it once more (a load from the snapshot); wall time of the whole process, medians over rounds, and whether the
two printed the same text.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from dartspec.assets import cache_dir


def run(model: str) -> tuple[float, str]:
    cmd = ["dartspec", "generate", "--model", model, "--chat", "--max-new-tokens", "32"]
    start = time.perf_counter()
    out = subprocess.run([*cmd, "--prompt", "Write a haiku about the sea."], capture_output=True, text=True, check=True)
    return time.perf_counter() - start, out.stdout


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    model = sys.argv[2] if len(sys.argv) > 2 else "smollm2-135m"
    run(model)  # the model converted and its packed cache written, outside the timing
    full, snap, same = [], [], True
    for _ in range(rounds):
        for f in (cache_dir() / "lean").glob(f"{model}-*.json"):
            f.unlink()
        (a, text_a), (b, text_b) = run(model), run(model)
        full.append(a)
        snap.append(b)
        same &= text_a == text_b
        print(f"full load {a:.2f} s, from the snapshot {b:.2f} s", flush=True)
    print(
        f"{model}: median {statistics.median(full):.2f} s -> {statistics.median(snap):.2f} s "
        f"({statistics.median(full) / statistics.median(snap):.2f}x), same text: {same}"
    )


if __name__ == "__main__":
    main()
