"""Constrained decoding to JSON (OpenAI's ``response_format`` ``json_object`` and ``json_schema``) or to plain text a
regular expression matches (vLLM's ``guided_regex`` and ``guided_choice``), lossless under speculation.

The answer must be a JSON object, or a document a JSON Schema admits (:mod:`dartspec.json_schema`): a token is allowed
where the text so far plus its bytes is still a prefix of one (:mod:`dartspec.json_grammar`), EOS only once the
document is whole, and nothing after it. The verifier asks this at each
tree node it walks, with the grammar state after that node's own path, and picks the target's choice among the
allowed tokens exactly as plain decoding would: greedy takes the most likely allowed token, sampling draws from the
target's distribution restricted to them. So drafts never change the answer, they only skip forwards (a draft the
grammar forbids is simply not accepted).

Checking is lazy: greedy tries the most likely tokens in order (almost always the first or second), sampling draws and
redraws without a rejected token (exact for the restricted distribution); only when many are refused is the whole
vocabulary checked for that grammar state, once per state: most tokens are ruled out by their first byte (a token led by
whitespace, where whitespace changes nothing, by its first other byte), inside a string only those holding a quote,
a backslash or a control byte need a look (the others fit by their length), and inside a string a pattern checks,
tokens whose characters all leave its automaton's state as it is fit at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import torch

from dartspec import json_grammar as jg
from dartspec.errors import DartspecError
from dartspec.json_schema import compile_schema

#: The response formats a request may name (besides a JSON Schema).
RESPONSE_FORMATS = ("text", "json_object")
#: What a request may ask the answer to be: "text", "json_object" (any JSON object), a JSON Schema, or a grammar
#: made already (:func:`dartspec.json_schema.compile_schema`, :meth:`~dartspec.json_grammar.Grammar.regex`, ...).
ResponseFormat: TypeAlias = str | Mapping[str, Any] | jg.Grammar
#: Most likely tokens greedy decoding tries before it checks the whole vocabulary.
GREEDY_TRIES = 32
#: Draws refused before sampling checks the whole vocabulary.
SAMPLE_TRIES = 16
#: Grammar states whose whole-vocabulary masks a sequence keeps.
MASK_CACHE = 256
#: JSON's whitespace bytes.
WHITESPACE = frozenset(b" \t\n\r")


def response_grammar(value: object, min_tokens: object = 0) -> jg.Grammar | None:
    """The grammar the answer must follow (None: free text). Refuses an unknown format, a schema it cannot follow
    (:class:`~dartspec.json_schema.SchemaError`), a bad ``min_tokens``, or both a JSON answer and ``min_tokens`` (it
    ends where its document does)."""
    if not isinstance(value, Mapping | jg.Grammar) and value not in RESPONSE_FORMATS:
        raise DartspecError(
            f"response_format must be one of {', '.join(RESPONSE_FORMATS)} or a JSON schema, got {value!r}"
        )
    if not (type(min_tokens) is int and min_tokens >= 0):
        raise DartspecError(f"min_tokens must be a non-negative integer, got {min_tokens!r}")
    if value == "text":
        return None
    if min_tokens:
        raise DartspecError(
            "min_tokens cannot be combined with a structured answer (JSON, a regex or a choice ends where its "
            "grammar does)"
        )
    if isinstance(value, jg.Grammar):
        return value
    return jg.Grammar.any_object() if value == "json_object" else compile_schema(value)


@dataclass(frozen=True)
class TokenTexts:
    """The UTF-8 bytes each token adds to a decoded text (what a grammar reads), for a whole vocabulary. Special tokens
    (decoded to nothing) and ids past the tokenizer are empty: never allowed as text."""

    pieces: tuple[bytes, ...]
    eos: frozenset[int]
    by_first_byte: dict[int, np.ndarray]  # first byte -> token ids starting with it
    # of the tokens that start with whitespace: the first other byte (-1: none) -> token ids
    by_first_solid_byte: dict[int, np.ndarray]
    string_safe: np.ndarray  # bool per token: non-empty, no quote, backslash or control byte (free inside a string)
    chars: np.ndarray  # characters per token, as the grammar counts them (bytes that do not continue a UTF-8 one)
    ascii_safe: np.ndarray  # bool per token: string-safe and all ASCII
    ascii_bits: np.ndarray  # of those, the characters each holds as two 64-bit masks (low, high); others 0

    @classmethod
    def of(cls, decode: Callable[[Sequence[int]], str], size: int, eos: frozenset[int], anchor: int) -> TokenTexts:
        """Each token decoded after ``anchor`` (so a SentencePiece token keeps the space a lone decode strips), the
        anchor's own text taken off; a piece of a multi-byte character decodes to U+FFFD, whose bytes (all >= 0x80)
        the grammar allows where that character's would be (inside strings)."""
        head = decode([anchor])
        pieces = []
        for token in range(size):
            text = decode([anchor, token])
            pieces.append((text[len(head) :] if text.startswith(head) else decode([token])).encode())
        firsts: dict[int, list[int]] = {}
        solid: dict[int, list[int]] = {}
        safe = np.zeros(size, dtype=bool)
        for token, piece in enumerate(pieces):
            if piece:
                firsts.setdefault(piece[0], []).append(token)
                safe[token] = min(piece) >= 0x20 and b'"' not in piece and b"\\" not in piece
                if piece[0] in WHITESPACE:
                    rest = piece.lstrip(bytes(WHITESPACE))
                    solid.setdefault(rest[0] if rest else -1, []).append(token)
        for token in eos:
            if token < size:
                safe[token] = False

        def arrays(ids: dict[int, list[int]]) -> dict[int, np.ndarray]:
            return {b: np.array(group, dtype=np.int64) for b, group in ids.items()}

        chars = np.array([sum(not 0x80 <= b < 0xC0 for b in piece) for piece in pieces], dtype=np.int64)
        plain = safe & np.array([bool(piece) and max(piece) < 0x80 for piece in pieces])
        bits = np.zeros((size, 2), dtype=np.uint64)
        for token in np.flatnonzero(plain).tolist():
            mask = sum(1 << b for b in set(pieces[token]))
            bits[token] = (mask & (2**64 - 1), mask >> 64)
        return cls(tuple(pieces), frozenset(eos), arrays(firsts), arrays(solid), safe, chars, plain, bits)


class JsonConstraint:
    """One sequence's constraint: the grammar state after its committed answer, and which tokens may follow a state."""

    def __init__(self, texts: TokenTexts, grammar: jg.Grammar) -> None:
        self.texts = texts
        self.grammar = grammar
        self.state: jg.State = grammar.start()
        self._masks: dict[jg.State, torch.Tensor] = {}

    def after(self, state: jg.State, token: int) -> jg.State | None:
        """The state after ``token``, or None where it is not allowed there (EOS: allowed once the value is whole,
        and leaves the state as it is)."""
        if token in self.texts.eos:
            return state if self.grammar.complete(state) else None
        if not 0 <= token < len(self.texts.pieces) or not self.texts.pieces[token]:
            return None
        return self.grammar.advance(state, self.texts.pieces[token])

    def commit(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            state = self.after(self.state, token)
            assert state is not None, "a committed token the constraint refused"
            self.state = state

    def mask(self, state: jg.State, width: int, device: torch.device) -> torch.Tensor:
        """Whether each token of a ``width``-wide row is allowed after ``state`` (the whole vocabulary checked)."""
        if state not in self._masks:
            if len(self._masks) >= MASK_CACHE:
                self._masks.clear()
            self._masks[state] = self._whole_mask(state)
        mask = self._masks[state]
        out = torch.zeros(width, dtype=torch.bool, device=device)
        n = min(width, len(mask))
        out[:n] = mask[:n].to(device)
        return out

    def _whole_mask(self, state: jg.State) -> torch.Tensor:
        texts = self.texts
        allowed = np.zeros(len(texts.pieces), dtype=bool)
        grammar = self.grammar
        room = grammar.string_room(state)
        loop = grammar.ascii_loop(state)
        if loop:  # in a string a pattern checks: tokens of characters that leave its state as it is fit
            outside = np.array([~loop & (2**64 - 1), (~loop >> 64) & (2**64 - 1)], dtype=np.uint64)
            allowed |= texts.ascii_safe & ~(texts.ascii_bits & outside).any(axis=1)
        if room is not None:  # tokens without a quote, backslash or control byte just extend the string, if it fits
            allowed |= texts.string_safe & (texts.chars <= room)
            candidates = np.flatnonzero(~texts.string_safe)
        else:
            after_byte = {b: grammar.advance(state, bytes([b])) for b in range(256)}
            # Where whitespace changes nothing (between JSON tokens), a token led by it goes as its first other byte:
            # most of a vocabulary starts with a space, and is ruled out there by what follows it.
            spaced = after_byte[0x20] == state and all(after_byte[w] in (state, None) for w in WHITESPACE)
            led = WHITESPACE if spaced else frozenset()  # whitespace-led tokens taken by their first other byte
            groups = [ids for b, ids in texts.by_first_byte.items() if b not in led and after_byte[b] is not None]
            if spaced:
                groups += [ids for b, ids in texts.by_first_solid_byte.items() if b < 0 or after_byte[b] is not None]
            candidates = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
        for token in candidates.tolist():
            if not allowed[token] and self.after(state, token) is not None:
                allowed[token] = True
        for token in texts.eos:
            if token < len(allowed):
                allowed[token] = grammar.complete(state)
        return torch.from_numpy(allowed)

    def greedy(self, row: torch.Tensor, state: jg.State, argmax: int | None = None) -> int:
        """The most likely token of ``row`` allowed after ``state``."""
        first = int(row.argmax()) if argmax is None else argmax
        if self.after(state, first) is not None:
            return first
        for token in torch.topk(row, min(GREEDY_TRIES, row.shape[-1])).indices.tolist():
            if self.after(state, token) is not None:
                return token  # the first allowed in descending order: topk breaks ties by index, as argmax does
        allowed = self.mask(state, row.shape[-1], row.device)
        if not bool(allowed.any()):
            raise stuck_error()
        return int(row.masked_fill(~allowed, -torch.inf).argmax())

    def sample(self, probs: torch.Tensor, state: jg.State, draw: Callable[[torch.Tensor], int]) -> int:
        """A draw from ``probs`` restricted to the tokens allowed after ``state``: draw, and while the token is refused
        draw again without it (each refusal conditions on the rest, so the result has exactly the restricted law);
        after :data:`SAMPLE_TRIES` refusals, one draw from the whole-vocabulary restriction. ``draw(probs)`` takes one
        token by the verifier's generator."""
        for _ in range(SAMPLE_TRIES):
            token = draw(probs)
            if self.after(state, token) is not None:
                return token
            probs = probs.clone()
            probs[token] = 0.0
            if not bool(probs.sum() > 0):
                raise stuck_error()
        allowed = self.mask(state, probs.shape[-1], probs.device)
        probs = probs.masked_fill(~allowed, 0.0)
        if not bool(probs.sum() > 0):
            raise stuck_error()
        return draw(probs)


def stuck_error() -> DartspecError:
    """No token may continue the answer: the vocabulary cannot write what the grammar needs next."""
    return DartspecError(
        "no token of the vocabulary continues the constrained answer here (its JSON or pattern); ask for text instead"
    )
