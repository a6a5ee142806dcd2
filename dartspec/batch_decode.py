"""Static-batch decoding: many prompts at once on a runtime's own forward, for making training data.

The engine decodes one sequence (speculation is a latency tool); data generation wants throughput, which
comes from running many sequences per forward. Prompts are left-padded to one width and share one batched
KV cache (:class:`dartspec.kv_cache.TreeKVCache`, batch dimension B); every row carries its own positions
and a padding row attends only to itself (:meth:`dartspec.runtime.CausalRuntime.forward_batch`), so each
sequence computes what it computes alone, up to the rounding of batched matrix products. Greedy answers
equal plain greedy decoding per prompt (``tests/test_batch_decode.py``).

Rows that finish (an end-of-turn token or the token limit) are dropped from the batch and the cache once a
quarter of it is dead, so a batch of answers of mixed lengths does not keep paying for finished rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dartspec.errors import DartspecError
from dartspec.kv_cache import TreeKVCache
from dartspec.runtime import to_device

#: Drop finished rows once at most this fraction of the batch is still running.
COMPACT_BELOW = 0.75
#: Off the CPU, read the new tokens back every this many steps: each read waits for the device, and a device
#: kept waiting for the host's next launches runs a small model at a fraction of its speed. Rows that end in
#: between run on as padding until the read (a few wasted rows, never a wrong token).
DEVICE_CHECK_EVERY = 8
#: Prefill at most about this many prompt slots per forward (rows of a large batch in slices), which bounds the
#: prefill's attention masks and scores on a GPU decoding a thousand rows at once.
PREFILL_SLOTS = 65536


@dataclass(frozen=True)
class Answer:
    """One prompt's continuation: ``tokens`` (the end-of-turn token included when ``finished``)."""

    tokens: list[int]
    finished: bool


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _prefill(
    target: Any, ids: torch.Tensor, key_positions: torch.Tensor, capacity: int, slots: int
) -> tuple[torch.Tensor, TreeKVCache]:
    """The prompts' last hidden states and their batched cache, prefilled ``slots // width`` rows at a time."""
    rows, width = ids.shape
    step = max(1, slots // width)
    hidden, caches = [], []
    for r in range(0, rows, step):
        cache = target.new_cache(capacity)
        part = key_positions[r : r + step]
        hidden.append(target.forward_batch(ids[r : r + step], part, part, cache)[:, -1])
        caches.append(cache)
    cache = caches[0] if len(caches) == 1 else TreeKVCache.stack_rows(caches, capacity)
    return torch.cat(hidden), cache


@torch.inference_mode()
def decode_batch(
    target: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    stop_ids: frozenset[int] | None = None,
    check_every: int | None = None,
    prefill_slots: int = PREFILL_SLOTS,
) -> list[Answer]:
    """Continue every prompt by up to ``max_new_tokens`` tokens in one static batch.

    ``temperature`` 0 decodes greedily; above it samples from the tempered distribution with a generator
    seeded by ``seed`` (the same prompts, seed and ``check_every`` give the same answers on the same machine).
    ``stop_ids`` end a row (default: the target's end-of-turn tokens). ``check_every``: steps between reads of
    the new tokens (default 1 on a CPU, :data:`DEVICE_CHECK_EVERY` elsewhere)."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise DartspecError("a prompt is empty")
    if max_new_tokens < 1:
        raise DartspecError("max_new_tokens must be at least 1")
    device = target.device
    every = check_every or (1 if device.type == "cpu" else DEVICE_CHECK_EVERY)
    stop_set = frozenset(stop_ids if stop_ids is not None else target.eos_token_ids)
    stops = to_device(torch.tensor(sorted(stop_set)), device)
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)

    width = max(len(p) for p in prompts)
    rows, slots = len(prompts), width + max_new_tokens
    ids = torch.zeros((rows, width), dtype=torch.long)
    # Every slot's position for every row (-1: padding, or a row that has ended), filled in as decoding goes.
    key_positions = torch.full((rows, slots), -1, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        key_positions[i, width - len(p) : width] = torch.arange(len(p))
    ids, key_positions = to_device(ids, device), to_device(key_positions, device)
    hidden, cache = _prefill(target, ids, key_positions[:, :width], slots, prefill_slots)
    next_pos = to_device(torch.tensor([len(p) for p in prompts], dtype=torch.long), device)

    live = torch.arange(rows, device=device)  # the prompt each batch row holds
    running = torch.ones(rows, dtype=torch.bool, device=device)
    answers: list[list[int]] = [[] for _ in prompts]
    finished = [False] * rows
    unread: list[torch.Tensor] = []  # per step since the last read: the token and whether the row was running
    for step in range(max_new_tokens):
        tokens = _pick(target.logits(hidden), temperature, generator)
        unread += [tokens, running]
        running = running & ~torch.isin(tokens, stops)
        last = step == max_new_tokens - 1
        if last or (step + 1) % every == 0:
            # One transfer per read (each .tolist() on a GPU waits for it).
            table = torch.stack([live, *unread, running]).T.tolist()
            unread = []
            for row in table:
                prompt = row[0]
                for tok, run in zip(row[1:-1:2], row[2:-1:2], strict=True):
                    if run:
                        answers[prompt].append(tok)
                        finished[prompt] = tok in stop_set
            still = sum(row[-1] for row in table)
            if last or not still:
                break
            if still <= COMPACT_BELOW * live.numel():
                kept = running.nonzero()[:, 0]
                cache.select_rows(kept)
                live, running, tokens = live[kept], running[kept], tokens[kept]
                next_pos, key_positions = next_pos[kept], key_positions[kept]
        # Rows that ended but are still in the batch run on as padding (slot -1) until the next compaction.
        column = width + step
        key_positions[:, column] = torch.where(running, next_pos, -1)
        hidden = target.decode_step(tokens, next_pos, key_positions, column, cache)
        next_pos = next_pos + 1
    return [Answer(a, f) for a, f in zip(answers, finished, strict=True)]
