"""``dartspec data regenerate``: the target writes its own answers to real prompts (self-distillation).

A drafter learns to predict *this target's* outputs, so training answers come from the target itself:
the first user turn of each ShareGPT conversation goes through the chat template and the target
generates the answer (batched, greedy by default). With ``turns > 1`` the conversation goes on: user
turn k follows the target's own answers to turns 1..k-1 (as text, through the chat template; an answer
cut at ``max_new_tokens`` stays cut), and each turn is one sample with the same source index. Only
token ids are stored (two bytes a token, compressed); hidden states are recomputed during training. Shards are
written atomically per block of source indices, so a crash loses at most the shard in progress and
``--resume`` skips finished shards.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dartspec.batch_decode import decode_batch
from dartspec.data.shards import Record, read_manifest, shard_name, write_manifest, write_shard
from dartspec.errors import DartspecError
from dartspec.formats import DATA_SOURCES

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


def parse_range(text: str, source: str = "sharegpt") -> tuple[int, int]:
    """``"0:14000"`` -> (0, 14000); ShareGPT ranges are checked against the held-out and dev splits
    (self-written prompts are numbered by seed index and have no split)."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise DartspecError(f"--range must look like START:STOP (e.g. 0:14000), got {text!r}") from None
    if not 0 <= a < b:
        raise DartspecError(f"--range {text}: need 0 <= START < STOP")
    if source != "sharegpt":
        return a, b
    if b > 15000:
        raise DartspecError("ShareGPT indices >= 15000 are held out for evaluation: use --range within 0:15000")
    lo, hi = DEV_RANGE
    if a < lo < b:
        raise DartspecError(f"--range {text} mixes training and dev indices: dev is {lo}:{hi}, train below {lo}")
    return a, b


def _blocks(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    first = start - start % size
    return [(max(b, start), min(b + size, stop)) for b in range(first, stop, size)]


class _ShareGPTTurns:
    """The user turns of ShareGPT conversations ``lo:hi`` (a conversation ends at its first empty turn)."""

    def __init__(self, cfg: RegenConfig, lo: int, hi: int) -> None:
        from dartspec.data.sources import iter_sharegpt

        self.users: dict[int, list[str]] = {}
        self.skipped = 0
        for index, turns in iter_sharegpt(lo, hi):
            users = [t["content"] for t in turns if t["role"] == "user"]
            if not users or not users[0].strip():
                self.skipped += 1
                continue
            kept = []
            for text in users[: cfg.turns]:
                if not text.strip():
                    break
                kept.append(text)
            self.users[index] = kept

    @property
    def indices(self) -> list[int]:
        return list(self.users)

    def user_turns(self, turn: int, conversations: list[tuple[int, list[dict[str, str]]]]) -> dict[int, str]:
        return {i: self.users[i][turn] for i, _ in conversations if turn < len(self.users[i])}


class _SelfWrittenTurns:
    """User turns the target writes itself (:mod:`dartspec.data.self_prompts`), numbered by seed index (a first
    turn that repeats an earlier one is dropped where the turns are encoded: see :func:`regenerate`)."""

    def __init__(self, target: Any, cfg: RegenConfig, lo: int, hi: int, batch_size: int) -> None:
        self.target, self.cfg, self.batch_size = target, cfg, batch_size
        self.indices = list(range(lo, hi))
        self.skipped = 0

    def user_turns(self, turn: int, conversations: list[tuple[int, list[dict[str, str]]]]) -> dict[int, str]:
        from dartspec.data.self_prompts import pick_opener, write_user_turns

        texts: dict[int, str] = {}
        for b in range(0, len(conversations), self.batch_size):
            chunk = conversations[b : b + self.batch_size]
            openers = [pick_opener(self.cfg.seed, i) if turn == 0 else "" for i, _ in chunk]
            seed = self.cfg.seed * 1_000_003 + chunk[0][0] + 7919 * turn + 1
            written = write_user_turns(self.target, [h for _, h in chunk], openers, seed=seed)
            texts |= {index: text for (index, _), text in zip(chunk, written, strict=True) if text is not None}
        if turn == 0:
            self.skipped += len(conversations) - len(texts)
        return texts


def first_turn_key(prompt: Sequence[int] | np.ndarray) -> bytes:
    """What makes two first turns duplicates: the same prompt tokens."""
    return hashlib.sha256(np.asarray(prompt, dtype=np.int64).tobytes()).digest()


def _seen_before(out: Path, lo: int, cache: dict[str, set[bytes]]) -> set[bytes]:
    """First-turn keys of the finished shards that start below ``lo`` (read once per shard)."""
    from dartspec.data.shards import read_shard

    seen: set[bytes] = set()
    for path in sorted(out.glob("shard-*.npz")):
        if int(path.stem.split("-")[1]) >= lo:
            continue
        if path.name not in cache:
            keys, last = set(), None
            for rec in read_shard(path):
                if rec.index != last:  # a conversation's first record is its first turn
                    keys.add(first_turn_key(rec.tokens[: rec.prompt_len]))
                last = rec.index
            cache[path.name] = keys
        seen |= cache[path.name]
    return seen


def generate_batch(target: Any, prompts: list[list[int]], cfg: RegenConfig, generator_seed: int) -> list[Record]:
    """Answers for a batch of prompts in one static batch on the target's own runtime."""
    answers = decode_batch(target, prompts, cfg.max_new_tokens, temperature=cfg.temperature, seed=generator_seed)
    return [
        Record(np.asarray(p + a.tokens, dtype=np.int64), len(p), -1, a.finished)
        for p, a in zip(prompts, answers, strict=True)
    ]


def chat_template_hash(target: Any) -> str:
    template = getattr(target.tokenizer, "chat_template", "") or ""
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def _settings(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest without its summary, with defaults for settings added later (older folders resume)."""
    out = {k: v for k, v in manifest.items() if k != "summary"}
    out["config"] = {"turns": 1, **out.get("config", {})}
    return out


def _differences(existing: dict[str, Any], wanted: dict[str, Any]) -> str:
    """What a resume would change, as ``--max-new-tokens 256 (this run: 512)``, so the user can repeat it."""

    def flags(manifest: dict[str, Any]) -> dict[str, Any]:
        settings = _settings(manifest)
        cfg = dict(settings.pop("config"))
        cfg["range"] = f"{cfg.pop('start', '?')}:{cfg.pop('stop', '?')}"
        return {f"--{k.replace('_', '-')}": v for k, v in cfg.items()} | settings

    before, now = flags(existing), flags(wanted)
    keys = dict.fromkeys([*now, *before])  # both sides' settings, in order: one may lack a key the other has
    return ", ".join(f"{k} {before.get(k)} (this run: {now.get(k)})" for k in keys if before.get(k) != now.get(k))


def regenerate(
    target: Any,
    cfg: RegenConfig,
    out: Path,
    *,
    resume: bool,
    batch_size: int,
    log: Callable[[str], None],
    max_seconds: float | None = None,
) -> dict[str, Any]:
    """Regenerate answers for ``cfg.start:cfg.stop`` into shards under ``out``; returns a summary.

    ``max_seconds``: stop after the shard that crosses this time (a GPU window's slice); ``resume`` goes on."""
    if cfg.source not in DATA_SOURCES:
        raise DartspecError(f"unknown --source {cfg.source!r}: choose one of {', '.join(DATA_SOURCES)}")
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": "dartspec-regen",
        "config": asdict(cfg),
        "vocab_size": target.vocab_size,
        "chat_template": chat_template_hash(target),
        "dev_range": list(DEV_RANGE),
        "split": "dev" if cfg.source == "sharegpt" and cfg.start >= DEV_RANGE[0] else "train",
    }
    existing = read_manifest(out)
    if existing is not None or any(out.glob("shard-*.npz")):
        if not resume:
            raise DartspecError(f"{out} already holds data: pass --resume to continue it, or choose another --out")
        if existing is not None and _settings(existing) != _settings(manifest):
            raise DartspecError(
                f"{out} was made with other settings ({_differences(existing, manifest)}): "
                "repeat them, or use another --out"
            )
    write_manifest(out, manifest)

    blocks = _blocks(cfg.start, cfg.stop, cfg.shard_size)
    todo = [(lo, hi) for lo, hi in blocks if not (out / shard_name(lo, hi - 1)).exists()]
    if len(todo) < len(blocks):
        log(f"resuming: {len(blocks) - len(todo)} of {len(blocks)} shards already done")
    stats = {
        "shards": 0,
        "conversations": 0,
        "samples": 0,
        "skipped": 0,
        "prompt_tokens": 0,
        "answer_tokens": 0,
        "eos": 0,
    }
    # Where the time goes (each generation ends with a read of its tokens, so wall time is the device's too): the
    # target writing its own requests, answering them, and the rest (templates, tokenizer, shards).
    spent = {"request_seconds": 0.0, "answer_seconds": 0.0}
    start_time = time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(total=sum(hi - lo for lo, hi in todo), desc="regenerate", unit="conv")
    seen_cache: dict[str, set[bytes]] = {}
    for lo, hi in todo:
        turns: _ShareGPTTurns | _SelfWrittenTurns
        # Self-written first turns that repeat one of an earlier index (this block or an earlier shard) are dropped,
        # so the folder holds each request once whatever order its shards were made in.
        seen: set[bytes] | None = None
        if cfg.source == "self":
            turns = _SelfWrittenTurns(target, cfg, lo, hi, batch_size)
            seen = _seen_before(out, lo, seen_cache)
        else:
            turns = _ShareGPTTurns(cfg, lo, hi)
        bar.update(hi - lo - len(turns.indices))
        history: dict[int, list[dict[str, str]]] = {index: [] for index in turns.indices}
        records: list[Record] = []
        for turn in range(cfg.turns):
            began = time.perf_counter()
            texts = turns.user_turns(turn, list(history.items()))
            spent["request_seconds"] += time.perf_counter() - began
            if turn == 0:
                bar.update(len(history) - len(texts))
            prompts = []
            for index in list(history):
                if index not in texts:
                    del history[index]  # the conversation ends here
            turn_messages = {index: [*history[index], {"role": "user", "content": texts[index]}] for index in history}
            encoded = target.encode_chats(list(turn_messages.values()))  # one batch: the tokenizer's threads
            for (index, messages), ids in zip(turn_messages.items(), encoded, strict=True):
                if turn == 0 and seen is not None:  # a first turn's key: its prompt's tokens
                    key = first_turn_key(ids)
                    if key in seen:
                        del history[index]
                        stats["skipped"] += 1
                        bar.update(1)
                        continue
                    seen.add(key)
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
                began = time.perf_counter()
                got = generate_batch(target, [p for _, p in chunk], cfg, seed)
                spent["answer_seconds"] += time.perf_counter() - began
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
        stats["skipped"] += turns.skipped
        records.sort(key=lambda r: r.index)  # stable: a conversation's turns stay in order
        write_shard(out / shard_name(lo, hi - 1), records, target.vocab_size)
        stats["shards"] += 1
        if max_seconds is not None and time.perf_counter() - start_time > max_seconds and (lo, hi) != todo[-1]:
            log(f"time limit reached after shard {shard_name(lo, hi - 1)}: run again with --resume to go on")
            break
    bar.close()
    elapsed = time.perf_counter() - start_time
    stats["seconds"] = round(elapsed, 1)
    stats |= {key: round(value, 2) for key, value in spent.items()}
    stats["answer_tokens_per_s"] = round(stats["answer_tokens"] / max(elapsed, 1e-9), 1)
    stats["eos_rate"] = round(stats["eos"] / max(stats["samples"], 1), 4)
    return stats
