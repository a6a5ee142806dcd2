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

#: Drop finished rows once at most this fraction of the batch is still running.
COMPACT_BELOW = 0.75


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


@torch.inference_mode()
def decode_batch(
    target: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    stop_ids: frozenset[int] | None = None,
) -> list[Answer]:
    """Continue every prompt by up to ``max_new_tokens`` tokens in one static batch.

    ``temperature`` 0 decodes greedily; above it samples from the tempered distribution with a generator
    seeded by ``seed`` (the same prompts and seed give the same answers on the same machine).
    ``stop_ids`` end a row (default: the target's end-of-turn tokens)."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise DartspecError("a prompt is empty")
    if max_new_tokens < 1:
        raise DartspecError("max_new_tokens must be at least 1")
    device = target.device
    stops = torch.tensor(sorted(stop_ids if stop_ids is not None else target.eos_token_ids), device=device)
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)

    width = max(len(p) for p in prompts)
    rows = len(prompts)
    ids = torch.zeros((rows, width), dtype=torch.long, device=device)
    key_positions = torch.full((rows, width), -1, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        key_positions[i, width - len(p) :] = torch.arange(len(p))
    cache = TreeKVCache(target.num_layers)
    hidden = target.forward_batch(ids, key_positions, key_positions, cache)[:, -1]
    next_pos = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)

    live = torch.arange(rows, device=device)  # the prompt each batch row holds
    running = torch.ones(rows, dtype=torch.bool, device=device)
    answers: list[list[int]] = [[] for _ in prompts]
    finished = [False] * rows
    for step in range(max_new_tokens):
        tokens = _pick(target.logits(hidden), temperature, generator)
        stopped = torch.isin(tokens, stops)
        # One transfer a step (each .tolist() on a GPU waits for it): prompt, token, running, stopped per row.
        still = 0
        for i, tok, run, stop in torch.stack([live, tokens, running, stopped]).T.tolist():
            if run:
                answers[i].append(tok)
                finished[i] = bool(stop)
                still += not stop
        running &= ~stopped
        if step == max_new_tokens - 1 or not still:
            break
        if still <= COMPACT_BELOW * live.numel():
            kept = running.nonzero()[:, 0]
            cache.select_rows(kept)
            live, running, tokens = live[kept], running[kept], tokens[kept]
            next_pos, key_positions = next_pos[kept], key_positions[kept]
        # Rows that finished but are still in the batch run on as padding (slot -1) until the next compaction.
        positions = next_pos[:, None]
        key_positions = torch.cat([key_positions, torch.where(running[:, None], positions, -1)], dim=1)
        hidden = target.forward_batch(tokens[:, None], positions, key_positions, cache)[:, -1]
        next_pos = next_pos + 1
    return [Answer(a, f) for a, f in zip(answers, finished, strict=True)]
