"""Prefill time of SmolLM2 for 128-2,048 random tokens: dartspec's default runtime and llama.cpp on the same GGUF file
(llama-cpp-python, the bench's loading), interleaved in one process, best of 3 each.

.venv/bin/python docs/bench/prefill-heads-2026-12-07/prefill_vs_llamacpp.py
"""

import time

import llama_cpp
import numpy as np
import torch

from dartspec.bench.suite import _default_model_params, _llamacpp_extra_buffers
from dartspec.models import gguf_file
from dartspec.targets import load_target

target = load_target("smollm2-135m")
path = gguf_file(target.name)
with _default_model_params(llama_cpp, use_extra_bufts=_llamacpp_extra_buffers(path)):
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=4096, n_threads=torch.get_num_threads(), verbose=False)
ids = np.random.default_rng(0).integers(100, 40000, size=2048).tolist()
target.prefill(ids[:64])
llm.eval(ids[:64])


def ours(n: int) -> float:
    target.reset()
    start = time.perf_counter()
    target.prefill(ids[:n])
    return time.perf_counter() - start


def theirs(n: int) -> float:
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids[:n])
    return time.perf_counter() - start


for n in (128, 512, 2048):
    a, b = [], []
    for _ in range(3):
        a.append(ours(n))
        b.append(theirs(n))
    print(f"{n} tokens: dartspec {min(a):.3f} s, llama.cpp {min(b):.3f} s, {min(b) / min(a):.2f}x llama.cpp's speed")
