"""``dartspec chat``: each turn answers the whole conversation so far, as a generation of those messages would."""

from __future__ import annotations

import io
import subprocess

import pytest
from conftest import tiny_target
from test_cli import run_in_process

from dartspec.chat import run_chat
from dartspec.drafters import NoDrafter, PromptLookupDrafter
from dartspec.engine import Generator

TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def generator() -> Generator:
    target = tiny_target("llama")
    target.tokenizer.chat_template = TEMPLATE
    return Generator(target, PromptLookupDrafter(), tree_size=6)


def chat(generator: Generator, lines: list[str], **kw) -> tuple[list[dict[str, str]], list[str], list[str]]:
    """The conversation, the answers as written (one per turn) and the log."""
    feed = iter(lines)
    written: list[str] = []
    log: list[str] = []
    messages = run_chat(generator, lambda: next(feed, None), written.append, log.append, max_new_tokens=8, **kw)
    answers = "".join(written).split("\n")[:-1]
    return messages, answers, log


def test_each_turn_answers_the_conversation_so_far(generator: Generator) -> None:
    messages, answers, log = chat(generator, ["t2 t3 t4", "", "t5 t6", "/reset", "/rset", "t2 t3 t4", "/quit", "t7"])
    assert any(line.startswith("unknown command /rset") for line in log)  # no turn
    plain = Generator(generator.target, NoDrafter())
    first = plain.generate([{"role": "user", "content": "t2 t3 t4"}], max_new_tokens=8).text
    second = plain.generate(
        [
            {"role": "user", "content": "t2 t3 t4"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "t5 t6"},
        ],
        max_new_tokens=8,
    ).text
    assert answers == [first, second, first]  # the blank line is no turn; /reset forgets; /quit ends before t7
    assert messages == [{"role": "user", "content": "t2 t3 t4"}, {"role": "assistant", "content": first}]


def test_system_message_seeds_and_stats(generator: Generator) -> None:
    lines = ["t2 t3", "t4"]
    a, answers_a, log = chat(generator, lines, system="t9", seed=5, temperature=1.0, report=lambda r: "stats")
    b, answers_b, _ = chat(generator, lines, system="t9", seed=5, temperature=1.0)
    assert a == b and answers_a == answers_b  # a seeded conversation replays
    assert a[0] == {"role": "system", "content": "t9"} and log == ["stats", "stats"]
    # Turn k draws with seed + k: the second answer is that of the conversation generated on its own.
    second = generator.generate(a[:4], max_new_tokens=8, temperature=1.0, seed=6).text
    assert a[4]["content"] == second


def test_a_turn_over_the_context_window_is_refused_and_the_conversation_goes_on(generator: Generator) -> None:
    long = " ".join(["t3"] * 4 * generator.target.max_context)
    messages, answers, log = chat(generator, [long, "t2 t3 t4"])
    assert len(answers) == 1 and [m["content"] for m in messages if m["role"] == "user"] == ["t2 t3 t4"]
    assert any("context window" in line and "/reset" in line for line in log)


def test_ctrl_c_stops_an_answer_and_keeps_what_was_said(generator: Generator) -> None:
    feed = iter(["t2 t3 t4", "t5"])
    written: list[str] = []

    def write(text: str) -> None:
        if not written:
            written.append(text)
            raise KeyboardInterrupt  # the user pressed Ctrl-C while the first answer streamed
        written.append(text)

    log: list[str] = []
    messages = run_chat(generator, lambda: next(feed, None), write, log.append, max_new_tokens=8)
    assert "\n[stopped]" in log
    assert messages[1] == {"role": "assistant", "content": written[0]}  # the part shown before Ctrl-C
    assert len(messages) == 4  # and the next turn ran


@pytest.mark.slow
def test_cli_chat_on_smollm2_equals_plain_decoding_without_the_prefix_cache(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chat with dart+pld (named: `auto` would first measure the machine) and the prefix cache reusing earlier turns'
    prompt blocks on the runtime's own cache says what plain decoding without the cache says, turn for turn."""
    lines = "Name a colour.\nAnd another one?\n/reset\nName a colour.\nWhat rhymes with it?\n"

    def run(*flags: str) -> subprocess.CompletedProcess:
        monkeypatch.setattr("sys.stdin", io.StringIO(lines))
        return run_in_process(capsys, "chat", "--max-new-tokens", "24", *flags)

    default = run("--drafter", "dart+pld")
    plain = run("--drafter", "none", "--prefix-cache-mb", "0")
    assert default.returncode == 0 and plain.returncode == 0, default.stderr + plain.stderr
    assert default.stdout == plain.stdout and default.stdout.count("\n") == 4
    assert "prefix cache off" not in default.stderr and "[conversation cleared]" in default.stderr


def test_ctrl_c_before_a_word_drops_the_turn(generator: Generator) -> None:
    class InterruptedOnce:
        """The generator, but Ctrl-C arrives during the first turn's prefill."""

        calls = 0

        def stream(self, *args, **kwargs):
            InterruptedOnce.calls += 1
            if InterruptedOnce.calls == 1:
                raise KeyboardInterrupt
            return generator.stream(*args, **kwargs)

    feed = iter(["t2 t3 t4", "t5"])
    messages = run_chat(InterruptedOnce(), lambda: next(feed, None), lambda _: None, lambda _: None, max_new_tokens=8)
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "t5"
