"""The C kernels of this checkout against those of another revision (default HEAD), interleaved in one process, at
growing context lengths.

Usage: python ab_kernels.py [REV] [PER_LENGTH]. REV's C sources are built into a library in a temporary folder and
loaded beside this checkout's; a SmolLM2 target (and its generators' drafters) is built on each, and every prompt is
decoded greedily (96 new tokens) by plain decoding and the CPU default (``dart+pld``, 4 nodes, DART's share 3) on
both, in a rotating order. Prompts: development prompts (ShareGPT 14000+) alone, and 12 / 40 of them joined and
followed by a request to summarize (about 430 / 1,380 tokens of context). Prints the per-prompt decoding-speed ratio
new / old (median, IQR) per length and method, and how many prompts' four outputs differ.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dartspec import exact
from dartspec.methods import GeneratorSpec, build_generator
from dartspec.targets import load_target

ROOT = Path(__file__).resolve().parents[3]
DEV80 = ROOT / "docs" / "bench" / "cpu-default-dart-pld-2026-11-26" / "dev80.jsonl"


def library_at(rev: str) -> ctypes.CDLL:
    """The kernel library built from ``rev``'s C sources (a copy of the sources in a temporary folder, built there)."""
    import tempfile

    tmp = Path(tempfile.mkdtemp())
    for src in (*exact._SOURCES, *exact._HEADERS):
        rel = src.relative_to(ROOT)
        (tmp / src.name).write_bytes(
            subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True, check=True).stdout
        )
    sources = [str(tmp / s.name) for s in exact._SOURCES]
    cmd = ["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *sources, "-o", str(tmp / "old.so")]
    gomp = exact._torch_libgomp()
    if gomp is not None:
        cmd += [f"-Wl,-rpath,{gomp.parent}", str(gomp)]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(tmp / "old.so"))


@contextlib.contextmanager
def kernels(lib: ctypes.CDLL | None):
    """Targets and drafters built inside bind ``lib``'s kernels (None: this checkout's) at construction."""
    if lib is None:
        yield
        return
    mine = exact._library()
    for name in (
        "dartspec_block",
        "dartspec_block_many",
        "dartspec_blocks",
        "dartspec_logits",
        "dartspec_rms_norm",
        "dartspec_qdot",
        "dartspec_attend",
        "dartspec_attend_seqs",
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = getattr(mine, name).restype, getattr(mine, name).argtypes
    real = exact._library
    exact._library = lambda: lib
    try:
        yield
    finally:
        exact._library = real


def main(rev: str = "HEAD", per_length: int = 6) -> None:
    texts = [json.loads(line)["prompt"] for line in DEV80.read_text().splitlines()]
    lengths = {"dev": 0, "join12": 12, "join40": 40}
    prompts = []
    for name, n in lengths.items():
        for i in range(per_length):
            body = texts[40 + i] if n == 0 else "\n\n".join(texts[i * n % 40 : i * n % 40 + n])
            prompts.append((name, body if n == 0 else body + "\n\nSummarize the texts above in one paragraph."))
    hybrid, gens = GeneratorSpec(drafter="dart+pld", tree_size=4, draft_nodes=3), {}
    for tag, lib in (("old", library_at(rev)), ("new", None)):
        with kernels(lib):
            target = load_target("smollm2-135m")
            gens[f"ar_{tag}"] = build_generator(target, GeneratorSpec())
            gens[f"def_{tag}"] = build_generator(target, hybrid)
    gens = {k: gens[k] for k in ("ar_old", "ar_new", "def_old", "def_new")}
    for gen in gens.values():
        gen.generate(prompts[0][1], chat=True, max_new_tokens=8)
    names = list(gens)
    rows: dict[tuple[str, str], list[float]] = {}
    ctx: dict[str, list[int]] = {}
    differ = 0
    for i, (length, prompt) in enumerate(prompts):
        speed, outs = {}, set()
        for name in names[i % 4 :] + names[: i % 4]:
            start = time.perf_counter()
            result = gens[name].generate(prompt, chat=True, max_new_tokens=96)
            speed[name] = len(result.token_ids) / (time.perf_counter() - start)
            outs.add(tuple(result.token_ids))
        ctx.setdefault(length, []).append(len(gens["ar_new"].encode(prompt, chat=True)))
        differ += len(outs) > 1
        for m in ("ar", "def"):
            rows.setdefault((length, m), []).append(speed[f"{m}_new"] / speed[f"{m}_old"])
    for (length, m), r in rows.items():
        q1, q3 = np.percentile(r, [25, 75])
        print(
            f"{length:7s} (~{int(np.median(ctx[length]))} tokens) {m:3s} new/old median {np.median(r):.3f}x IQR "
            f"{q1:.3f}-{q3:.3f}"
        )
    print("prompts whose four outputs differ:", differ)


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["HEAD"]), *(int(a) for a in sys.argv[2:3]))
