"""Self-generated prompts: the target writes the user requests it then answers.

A chat model has learnt what user turns look like, so given its chat template up to an open user turn it
samples a plausible request (the idea of Magpie, Xu et al. 2024). A seeded *opener* (the first words of
the request, e.g. "Write a Rust function") steers each sample towards a category, so the mix covers code
in several languages, math, reasoning, writing, role-play, extraction and advice rather than whatever the
model drifts to; an empty opener leaves it free. Follow-up turns are sampled the same way after the
conversation so far (the target's own answers included).

Everything is a function of ``(seed, index)``: the same seed gives the same requests (on the same machine
and runtime). Requests that do not end their turn within the token limit, are too short, or repeat an
earlier one are dropped. No evaluation set (MT-Bench, HumanEval, ShareGPT >= 15000) or library source is
involved: the model writes the text itself.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from dartspec.batch_decode import decode_batch
from dartspec.errors import DartspecError

#: Category -> openers; a sample picks a category uniformly, then an opener.
OPENERS: dict[str, tuple[str, ...]] = {
    "python": ("Write a Python function", "Write a Python script", "How do I fix this Python", "Explain this Python"),
    "web": ("Write a JavaScript function", "How do I fix this JavaScript", "Write a TypeScript", "Create an HTML page"),
    "systems": ("Write a C function", "Write a C++ class", "Write a Rust function", "Write a Go program"),
    "other code": ("Write a SQL query", "Write a Bash script", "Write a Java class", "Explain the difference between"),
    "math": ("Solve", "Calculate", "Prove that", "A store sells", "What is the probability"),
    "reasoning": ("If", "Explain why", "Compare", "What would happen if", "Which is better"),
    "writing": ("Write a short story", "Write a poem", "Write an email", "Write a blog post", "Rewrite"),
    "role-play": ("Let's role-play", "Pretend you are", "Act as", "You are a"),
    "extraction": ("Extract", "Summarize", "List the", "Classify the following", "Translate"),
    "advice": ("How can I", "What are some tips", "Can you help me", "I need advice"),
    "free": ("",),
}

_MARKER = "\u2063dartspec-user\u2063"  # stands for the user text when cutting the chat template


def pick_opener(seed: int, index: int) -> str:
    """The opener of request ``index`` under ``seed`` (a fixed function of both)."""
    rng = random.Random(seed * 1_000_003 + index)
    category = rng.choice(sorted(OPENERS))
    return rng.choice(OPENERS[category])


def open_user_turn(target: Any, history: Sequence[dict[str, str]]) -> str:
    """The chat-template text of ``history`` followed by an opened, still empty user turn."""
    if not getattr(target.tokenizer, "chat_template", None):
        raise DartspecError(f"{target.name} has no chat template: self-generated prompts need a chat model")
    text = target.tokenizer.apply_chat_template(
        [*history, {"role": "user", "content": _MARKER}], tokenize=False, add_generation_prompt=False
    )
    return text[: text.index(_MARKER)]


def _clean(text: str, min_chars: int) -> str | None:
    text = text.strip()
    if len(text) < min_chars or _MARKER in text:
        return None
    return text


def write_user_turns(
    target: Any,
    histories: Sequence[Sequence[dict[str, str]]],
    openers: Sequence[str],
    *,
    seed: int,
    temperature: float = 0.8,
    max_tokens: int = 160,
    min_chars: int = 12,
) -> list[str | None]:
    """The target's next user turn after each history (empty for a first turn), starting with its opener;
    None where the sample did not end its turn within ``max_tokens`` or came out too short."""
    first = open_user_turn(target, []) if not all(histories) else ""  # every first turn opens alike
    starts = [open_user_turn(target, history) if history else first for history in histories]
    texts = [start + opener for start, opener in zip(starts, openers, strict=True)]
    prompts = target.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []  # one batch
    special = set(getattr(target.tokenizer, "all_special_ids", []))
    answers = decode_batch(target, prompts, max_tokens, temperature=temperature, seed=seed)
    out: list[str | None] = []
    for start, opener, prompt, answer in zip(starts, openers, prompts, answers, strict=True):
        body = answer.tokens[:-1]
        if not answer.finished or any(t in special for t in body):
            out.append(None)
            continue
        # Decode with the prompt so that the first word keeps its leading space under every tokenizer.
        full = target.tokenizer.decode(prompt + body, skip_special_tokens=False)
        text = full[len(start) :] if full.startswith(start) else opener + target.tokenizer.decode(body)
        out.append(_clean(text, min_chars))
    return out
