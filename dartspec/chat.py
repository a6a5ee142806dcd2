"""A conversation on the terminal (``dartspec chat``): each turn's prompt is the conversation so far in the model's
chat template, and the answer streams as the target accepts it.

The loop only reads lines and writes text; the generator does the rest, so a turn is exactly what
:meth:`~dartspec.engine.Generator.stream` gives for the same messages (greedy: what plain decoding would say). With a
prefix cache on the target (``--prefix-cache-mb``, on by default where the runtime has one) a turn's prefill reuses
the blocks of the earlier turns' prompts instead of recomputing the whole conversation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from dartspec.engine import GenerationResult, Generator
from dartspec.errors import ContextLengthError

HELP = "/reset starts over, /quit (or Ctrl-D) ends; Ctrl-C stops an answer"


def run_chat(
    generator: Generator,
    read: Callable[[], str | None],
    write: Callable[[str], None],
    log: Callable[[str], None],
    *,
    system: str | None = None,
    seed: int | None = None,
    report: Callable[[GenerationResult], str] | None = None,
    **sampling: Any,
) -> list[dict[str, str]]:
    """Hold a conversation until ``read`` returns None or ``/quit``; returns its messages.

    ``read`` gives the user's next line (None: the input ended), ``write`` takes the answer's text as it streams,
    ``log`` the notes around it (stats after each answer when ``report`` formats them, errors). ``sampling``: keyword
    arguments of :meth:`~dartspec.engine.Generator.stream` (``max_new_tokens``, ``temperature``, ...); a ``seed``
    becomes ``seed + turn``, so a conversation replays the same while no two turns share their draws.
    """
    opening = [{"role": "system", "content": system}] if system else []
    messages = list(opening)
    turn = 0
    while (line := read()) is not None:
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            break
        if text == "/reset":
            messages = list(opening)
            log("[conversation cleared]")
            continue
        if text in ("/help", "/?"):
            log(HELP)
            continue
        if re.fullmatch(r"/[A-Za-z]+", text):  # a mistyped command is not a message to the model
            log(f"unknown command {text}: {HELP}")
            continue
        messages.append({"role": "user", "content": text})
        turn_seed = None if seed is None else seed + turn
        answer, result = [], None
        try:
            for event in generator.stream(messages, chat=True, seed=turn_seed, **sampling):
                answer.append(event.text)
                write(event.text)
                result = event.result or result
        except ContextLengthError as err:
            messages.pop()  # the turn did not happen: the user can /reset or say something shorter
            log(f"[{err}: /reset to start over]")
            continue
        except KeyboardInterrupt:
            log("\n[stopped]")  # what was said so far stays in the conversation, as said
        said = result.text if result is not None else "".join(answer)
        write("\n")
        if not said and result is None:  # stopped before a word: the turn did not happen
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": said})
        if result is not None and report is not None:
            log(report(result))
        turn += 1
    return messages
