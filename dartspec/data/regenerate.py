"""``dartspec data regenerate``: the target writes its own answers to real prompts (self-distillation).

A drafter learns to predict *this target's* outputs, so training answers come from the target itself:
the first user turn of each ShareGPT conversation goes through the chat template and the target
generates the answer (batched, greedy by default). With ``turns > 1`` the conversation goes on: user
turn k follows the target's own answers to turns 1..k-1 (as text, through the chat template; an answer
cut at ``max_new_tokens`` stays cut), and each turn is one sample with the same source index. Only
token ids are stored (two bytes a token); hidden states are recomputed during training. Shards are
written atomically per block of source indices, so a crash loses at most the shard in progress and
``--resume`` skips finished shards.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dartspec.data.shards import Record, read_manifest, shard_name, write_manifest, write_shard
from dartspec.errors import DartspecError

DEV_RANGE = (14000, 15000)


@dataclass(frozen=True)
class RegenConfig:
    """Settings that define the data set (a resumed run must use the same ones)."""

    model: str
    source: str
    start: int
    stop: int
    max_prompt_tokens: int = 512
    max_new_tokens: int = 512
    temperature: float = 0.0
    seed: int = 0
    shard_size: int = 256
    turns: int = 1  # user turns per conversation answered by the target


def parse_range(text: str) -> tuple[int, int]:
    """``"0:14000"`` -> (0, 14000), checked against the held-out and dev splits."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise DartspecError(f"--range must look like START:STOP (e.g. 0:14000), got {text!r}") from None
    if not 0 <= a < b:
        raise DartspecError(f"--range {text}: need 0 <= START < STOP")
    if b > 15000:
        raise DartspecError("ShareGPT indices >= 15000 are held out for evaluation: use --range within 0:15000")
    lo, hi = DEV_RANGE
    if a < lo < b:
        raise DartspecError(f"--range {text} mixes training and dev indices: dev is {lo}:{hi}, train below {lo}")
    return a, b


def _blocks(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    first = start - start % size
    return [(max(b, start), min(b + size, stop)) for b in range(first, stop, size)]


def _conversations(cfg: RegenConfig, lo: int, hi: int) -> tuple[list[tuple[int, list[str]]], int]:
    """``(index, up to cfg.turns user messages)`` per usable conversation, and how many were skipped."""
    from dartspec.data.sources import iter_sharegpt

    out, skipped = [], 0
    for index, turns in iter_sharegpt(lo, hi):
        users = [t["content"] for t in turns if t["role"] == "user"]
        if not users or not users[0].strip():
            skipped += 1
            continue
        kept = []
        for text in users[: cfg.turns]:
            if not text.strip():
                break
            kept.append(text)
        out.append((index, kept))
    return out, skipped


@torch.inference_mode()
def generate_batch(target: Any, prompts: list[list[int]], cfg: RegenConfig, generator_seed: int) -> list[Record]:
    """Answers for a batch of prompts with transformers ``generate`` (left padding)."""
    pad = min(target.eos_token_ids)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kwargs: dict[str, Any] = {"do_sample": False}
    if cfg.temperature > 0:
        torch.manual_seed(generator_seed)
        kwargs = {"do_sample": True, "temperature": cfg.temperature, "top_k": 0, "top_p": 1.0}
    out = target.model.generate(
        input_ids=ids.to(target.device),
        attention_mask=mask.to(target.device),
        max_new_tokens=cfg.max_new_tokens,
        eos_token_id=sorted(target.eos_token_ids),
        pad_token_id=pad,
        **kwargs,
    )[:, width:].cpu()
    records = []
    for p, row in zip(prompts, out.tolist(), strict=True):
        answer, finished = [], False
        for tok in row:
            answer.append(tok)
            if tok in target.eos_token_ids:
                finished = True
                break
        records.append(Record(torch.tensor(p + answer).numpy(), len(p), -1, finished))
    return records


def chat_template_hash(target: Any) -> str:
    template = getattr(target.tokenizer, "chat_template", "") or ""
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def _settings(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest without its summary, with defaults for settings added later (older folders resume)."""
    out = {k: v for k, v in manifest.items() if k != "summary"}
    out["config"] = {"turns": 1, **out.get("config", {})}
    return out


def regenerate(
    target: Any,
    cfg: RegenConfig,
    out: Path,
    *,
    resume: bool,
    batch_size: int,
    log: Callable[[str], None],
    progress: Callable[[Iterable[Any], int], Iterable[Any]] | None = None,
) -> dict[str, Any]:
    """Regenerate answers for ``cfg.start:cfg.stop`` into shards under ``out``; returns a summary."""
    if cfg.source != "sharegpt":
        raise DartspecError(f"unknown --source {cfg.source!r}: only sharegpt is available offline")
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": "dartspec-regen",
        "config": asdict(cfg),
        "vocab_size": target.vocab_size,
        "chat_template": chat_template_hash(target),
        "dev_range": list(DEV_RANGE),
        "split": "dev" if cfg.start >= DEV_RANGE[0] else "train",
    }
    existing = read_manifest(out)
    if existing is not None or any(out.glob("shard-*.npz")):
        if not resume:
            raise DartspecError(f"{out} already holds data: pass --resume to continue it, or choose another --out")
        if existing is not None and _settings(existing) != _settings(manifest):
            raise DartspecError(f"{out} was made with other settings ({existing.get('config')}); use another --out")
    write_manifest(out, manifest)

    blocks = _blocks(cfg.start, cfg.stop, cfg.shard_size)
    todo = [(lo, hi) for lo, hi in blocks if not (out / shard_name(lo, hi - 1)).exists()]
    if len(todo) < len(blocks):
        log(f"resuming: {len(blocks) - len(todo)} of {len(blocks)} shards already done")
    stats = {"conversations": 0, "samples": 0, "skipped": 0, "prompt_tokens": 0, "answer_tokens": 0, "eos": 0}
    start_time = time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(total=sum(hi - lo for lo, hi in todo), desc="regenerate", unit="conv")
    for lo, hi in todo:
        conversations, skipped = _conversations(cfg, lo, hi)
        stats["skipped"] += skipped
        bar.update(skipped)
        history: dict[int, list[dict[str, str]]] = {index: [] for index, _ in conversations}
        records: list[Record] = []
        for turn in range(cfg.turns):
            prompts = []
            for index, users in conversations:
                if turn >= len(users) or index not in history:
                    continue
                messages = [*history[index], {"role": "user", "content": users[turn]}]
                ids = target.encode_chat(messages)
                if len(ids) > cfg.max_prompt_tokens:
                    del history[index]  # later turns would be longer still
                    if turn == 0:
                        stats["skipped"] += 1
                        bar.update(1)
                    continue
                history[index] = messages
                prompts.append((index, ids))
            # Similar lengths in a batch waste less compute on padding.
            order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][1]))
            for b in range(0, len(order), batch_size):
                chunk = [prompts[i] for i in order[b : b + batch_size]]
                seed = cfg.seed * 1_000_003 + chunk[0][0] + 7919 * turn
                got = generate_batch(target, [p for _, p in chunk], cfg, seed)
                for (index, _), rec in zip(chunk, got, strict=True):
                    records.append(Record(rec.tokens, rec.prompt_len, index, rec.finished))
                    answer = rec.tokens[rec.prompt_len :].tolist()
                    history[index].append({"role": "assistant", "content": target.decode(answer)})
                    stats["samples"] += 1
                    stats["prompt_tokens"] += rec.prompt_len
                    stats["answer_tokens"] += len(answer)
                    stats["eos"] += int(rec.finished)
                if turn == 0:
                    stats["conversations"] += len(chunk)
                    bar.update(len(chunk))
                elapsed = time.perf_counter() - start_time
                bar.set_postfix(turn=turn + 1, answer_tok_s=f"{stats['answer_tokens'] / max(elapsed, 1e-9):.0f}")
        records.sort(key=lambda r: r.index)  # stable: a conversation's turns stay in order
        write_shard(out / shard_name(lo, hi - 1), records, target.vocab_size)
    bar.close()
    elapsed = time.perf_counter() - start_time
    stats["seconds"] = round(elapsed, 1)
    stats["answer_tokens_per_s"] = round(stats["answer_tokens"] / max(elapsed, 1e-9), 1)
    stats["eos_rate"] = round(stats["eos"] / max(stats["samples"], 1), 4)
    return stats
