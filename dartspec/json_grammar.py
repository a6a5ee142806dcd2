"""An incremental recognizer of JSON text (RFC 8259), byte by byte: which prefixes can still become a JSON document.

A state is a small hashable tuple ``(stack, mode, aux)``: ``stack`` the open containers (``"o"`` object, ``"a"``
array, innermost last), ``mode`` what the next byte may be, ``aux`` the mode's detail (the rest of a literal, or
for strings whether it is a key and how many hex digits a ``\\u`` escape still needs). :func:`advance` takes bytes
and returns the state after them, or None as soon as no JSON document starts with what was read; :func:`complete`
says whether what was read is a whole document (after which nothing but its end may follow: trailing whitespace is
not taken, so a constrained answer ends where its value does).

Strings take any byte from 0x20 up but ``"`` and ``\\`` (UTF-8 is the tokenizer's business: a multi-byte character
split over tokens arrives in pieces), control bytes only escaped. Numbers end at the first byte that cannot extend
them, which then counts as what follows the number (a number at the top level is complete only at the end).
"""

from __future__ import annotations

from typing import TypeAlias

State: TypeAlias = tuple[str, int, object]

# Modes
VALUE, VALUE_OR_CLOSE, KEY_OR_CLOSE, KEY, COLON, AFTER, DONE = range(7)
STRING, ESCAPE, UNICODE = range(7, 10)
MINUS, ZERO, INT, DOT, FRAC, EXP, EXP_SIGN, EXP_DIGITS = range(10, 18)
LITERAL = 18
TOP_OBJECT = 19  # the start of a document that must be an object (OpenAI's ``json_object``)

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_LITERALS = {ord("t"): "rue", ord("f"): "alse", ord("n"): "ull"}
#: Number modes in which the number read so far is whole (it may still go on).
_NUMBER_ENDS = frozenset({ZERO, INT, FRAC, EXP_DIGITS})


def start(object_only: bool = False) -> State:
    """The state before any byte: any JSON value, or with ``object_only`` an object, starting at once (no whitespace
    before it)."""
    return ("", TOP_OBJECT if object_only else VALUE, None)


def complete(state: State) -> bool:
    """Whether the bytes read make a whole JSON document."""
    stack, mode, _ = state
    return mode == DONE or (not stack and mode in _NUMBER_ENDS)


def advance(state: State | None, data: bytes) -> State | None:
    """The state after ``data``, or None where no JSON document starts with the bytes read."""
    for byte in data:
        if state is None:
            return None
        state = _step(state, byte)
    return state


def _after_value(stack: str) -> State:
    return (stack, AFTER, None) if stack else ("", DONE, None)


def _step(state: State, b: int) -> State | None:
    stack, mode, aux = state
    if mode == STRING:
        if b == 0x22:  # '"'
            return (stack, COLON, None) if aux else _after_value(stack)
        if b == 0x5C:  # '\\'
            return (stack, ESCAPE, aux)
        return state if b >= 0x20 else None
    if mode == ESCAPE:
        if b == 0x75:  # 'u'
            return (stack, UNICODE, (aux, 4))
        return (stack, STRING, aux) if b in _ESCAPES else None
    if mode == UNICODE:
        key, left = aux  # type: ignore[misc]
        if b not in _HEX:
            return None
        return (stack, STRING, key) if left == 1 else (stack, UNICODE, (key, left - 1))
    if mode >= MINUS and mode <= EXP_DIGITS:
        return _number(stack, mode, b)
    if mode == LITERAL:
        rest = str(aux)
        if b != ord(rest[0]):
            return None
        return _after_value(stack) if len(rest) == 1 else (stack, LITERAL, rest[1:])
    if mode == TOP_OBJECT:  # the object first: no whitespace a model could pad its answer with forever
        return ("o", KEY_OR_CLOSE, None) if b == 0x7B else None
    if b in _WS:
        return None if mode == DONE else state
    if mode in (VALUE, VALUE_OR_CLOSE):
        if mode == VALUE_OR_CLOSE and b == 0x5D:  # ']'
            return _after_value(stack[:-1])
        return _value(stack, b)
    if mode in (KEY_OR_CLOSE, KEY):
        if b == 0x22:
            return (stack, STRING, True)
        return _after_value(stack[:-1]) if mode == KEY_OR_CLOSE and b == 0x7D else None
    if mode == COLON:
        return (stack, VALUE, None) if b == 0x3A else None
    if mode == AFTER:
        top = stack[-1]
        if b == 0x2C:  # ','
            return (stack, KEY, None) if top == "o" else (stack, VALUE, None)
        if b == (0x7D if top == "o" else 0x5D):
            return _after_value(stack[:-1])
        return None
    return None  # DONE: nothing may follow the document


def _value(stack: str, b: int) -> State | None:
    """The first byte of a value."""
    if b == 0x7B:  # '{'
        return (stack + "o", KEY_OR_CLOSE, None)
    if b == 0x5B:  # '['
        return (stack + "a", VALUE_OR_CLOSE, None)
    if b == 0x22:
        return (stack, STRING, False)
    if b == 0x2D:  # '-'
        return (stack, MINUS, None)
    if b == 0x30:
        return (stack, ZERO, None)
    if b in _DIGITS:
        return (stack, INT, None)
    if b in _LITERALS:
        return (stack, LITERAL, _LITERALS[b])
    return None


def _number(stack: str, mode: int, b: int) -> State | None:
    digit = b in _DIGITS
    if mode == MINUS:
        return (stack, ZERO if b == 0x30 else INT, None) if digit else None
    if mode in (DOT, EXP_SIGN):
        return (stack, FRAC if mode == DOT else EXP_DIGITS, None) if digit else None
    if mode == EXP:
        if b in (0x2B, 0x2D):
            return (stack, EXP_SIGN, None)
        return (stack, EXP_DIGITS, None) if digit else None
    # ZERO, INT, FRAC, EXP_DIGITS: the number is whole; it goes on or ends at this byte
    if digit and mode != ZERO:
        return (stack, mode, None)
    if b == 0x2E and mode in (ZERO, INT):  # '.'
        return (stack, DOT, None)
    if b in (0x65, 0x45) and mode != EXP_DIGITS:  # 'e', 'E'
        return (stack, EXP, None)
    if not stack:
        return None  # a top-level number: nothing may follow it
    return _step((stack, AFTER, None), b)
