"""JSON Schema ``pattern`` against Python's ``re`` (an independent matcher) on random patterns and strings: a JSON
string is whole exactly when its text matches (and its length is within the bounds), written with escapes or not, and
a prefix lives exactly when some completion still matches (no dead ends). ECMA-262's own meanings (ASCII classes, ``.``
without line ends, ``$`` only at the very end), the anchors and what is refused are checked by hand."""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import json
import random
import re
import uuid
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dartspec.json_grammar import Grammar
from dartspec.json_pattern import Pattern, PatternError
from dartspec.json_schema import FORMATS, SchemaError, compile_schema

# Random patterns as (ECMA-262 text, Python text with the same meaning): Python's '.' also matches '\r' and its '$'
# a trailing '\n', so those are spelled out for it.
_ATOMS = st.sampled_from(
    [
        ("a", "a"),
        ("b", "b"),
        ('"', '"'),
        ("\\.", "\\."),
        (".", "[^\\n\\r\\u2028\\u2029]"),
        ("[ab]", "[ab]"),
        ("[^a]", "[^a]"),
        ("[a-c]", "[a-c]"),
        ("\\d", "[0-9]"),
        ("\\w", "[A-Za-z0-9_]"),
        ("é", "é"),
        ("\\u00e9", "\\u00e9"),
        ("\\n", "\\n"),
    ]
)
_QUANTIFIERS = st.sampled_from(["", "", "*", "+", "?", "{2}", "{0,2}", "{1,}", "*?"])


def _extend(inner: st.SearchStrategy[tuple[str, str]]) -> st.SearchStrategy[tuple[str, str]]:
    seq = st.lists(inner, min_size=1, max_size=3).map(lambda ps: ("".join(p[0] for p in ps), "".join(p[1] for p in ps)))
    alt = st.lists(inner, min_size=2, max_size=3).map(
        lambda ps: ("(?:" + "|".join(p[0] for p in ps) + ")", "(?:" + "|".join(p[1] for p in ps) + ")")
    )
    group = st.tuples(seq | alt, _QUANTIFIERS).map(lambda t: ("(" + t[0][0] + ")" + t[1], "(" + t[0][1] + ")" + t[1]))
    return seq | alt | group


_BODIES = st.recursive(
    st.tuples(_ATOMS, _QUANTIFIERS).map(lambda t: (t[0][0] + t[1], t[0][1] + t[1])), _extend, max_leaves=6
)


@st.composite
def patterns(draw: st.DrawFn) -> tuple[str, str]:
    """Top-level alternatives, each anchored at either end or not."""
    ecma, python = [], []
    for body, py in draw(st.lists(_BODIES, min_size=1, max_size=2)):
        head, tail = draw(st.booleans()), draw(st.booleans())
        ecma.append(("^" if head else "") + body + ("$" if tail else ""))
        python.append(("^" if head else "") + "(?:" + py + ")" + ("\\Z" if tail else ""))
    return "|".join(ecma), "|".join(f"(?:{p})" for p in python)


TEXTS = st.text(st.sampled_from(list('ab"c.é1_\n\r-')), max_size=7)


def string_schema(pattern: str, low: int | None, high: int | None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "pattern": pattern}
    if low is not None:
        schema["minLength"] = low
    if high is not None:
        schema["maxLength"] = high
    return schema


def matches(python: str, text: str, low: int | None, high: int | None) -> bool:
    return re.search(python, text) is not None and (low or 0) <= len(text) <= (len(text) if high is None else high)


def whole(grammar: Grammar, data: bytes) -> bool:
    state = grammar.advance(grammar.start(), data)
    return state is not None and grammar.complete(state)


def _bounds() -> st.SearchStrategy[tuple[int | None, int | None]]:
    return st.tuples(st.none() | st.integers(0, 3), st.none() | st.integers(3, 6))


@settings(max_examples=300, deadline=None)
@given(pattern=patterns(), text=TEXTS, bounds=_bounds(), ascii_only=st.booleans())
def test_a_string_is_whole_exactly_when_the_pattern_matches(
    pattern: tuple[str, str], text: str, bounds: tuple[int | None, int | None], ascii_only: bool
) -> None:
    ecma, python = pattern
    schema = string_schema(ecma, *bounds)
    expected = matches(python, text, *bounds)
    try:
        grammar = compile_schema(schema)
    except SchemaError as err:  # refused only where nothing matches within the bounds
        assert "admits no finite document" in str(err)
        return
    data = json.dumps(text, ensure_ascii=ascii_only).encode()
    assert whole(grammar, data) == expected, (ecma, text, data)
    if expected:
        jsonschema.validate(text, schema)  # the validator agrees with the reference
        state = grammar.start()
        for i in range(len(data)):  # byte by byte: every prefix alive, split characters and escapes included
            state = grammar.advance(state, data[i : i + 1])
            assert state is not None, (ecma, data[: i + 1])


# Completions over characters that stand for every class the random patterns tell apart.
_ALPHABET = list('ab"c.é1_\n\r')


def _completable(python: str, prefix: str, low: int | None, high: int | None, depth: int) -> bool:
    for n in range(depth + 1):
        for rest in itertools.product(_ALPHABET, repeat=n):
            if matches(python, prefix + "".join(rest), low, high):
                return True
    return False


@settings(max_examples=120, deadline=None)
@given(pattern=patterns(), text=TEXTS, bounds=_bounds())
def test_a_prefix_lives_exactly_while_some_completion_matches(
    pattern: tuple[str, str], text: str, bounds: tuple[int | None, int | None]
) -> None:
    """A live state's shortest completion (a witness) makes a match for Python's ``re``; a state found dead has no
    completion of up to four characters either (a search over characters that stand for every class here)."""
    ecma, python = pattern
    automaton = Pattern(ecma, bounds[0] or 0, bounds[1])
    state: tuple[int, int] | None = (automaton.start, 0)
    for i in range(len(text) + 1):
        alive = state is not None and automaton.live(*state)
        if not alive:
            assert not _completable(python, text[:i], *bounds, depth=4), (ecma, text[:i])
            return
        assert state is not None
        witness = automaton.completion(*state)
        assert witness is not None and matches(python, text[:i] + witness, *bounds), (ecma, text[:i], witness)
        if i < len(text):
            state = automaton.step(*state, ord(text[i]))


def test_ecma_meanings_anchors_escapes_and_split_characters() -> None:
    def ok(pattern: str, text: str, **bounds: int) -> bool:
        return whole(compile_schema({"type": "string", "pattern": pattern, **bounds}), json.dumps(text).encode())

    assert ok("b", "abc") and not ok("^b", "abc") and not ok("b$", "abc") and ok("^a|c$", "xyc")
    assert ok("^\\d+$", "123") and not ok("^\\d+$", "١٢")  # ASCII digits only, as ECMA-262 without the u flag
    assert ok("^.$", "é") and not ok("^.$", "\r") and not ok("^a$", "a\n")  # '$' is the very end
    assert ok('^"\\\\$', '"\\') and ok("^\\u00e9\\x41$", "éA") and ok("^[^]$", "\n")
    assert ok("^a{2,3}$", "aaa") and not ok("^a{2,3}$", "aaaa") and ok("^a{,2}$", "a{,2}")  # '{' not a quantifier
    assert ok("^\\w{2,}$", "ab", maxLength=5) and not ok("^\\w{2,}$", "abcdef", maxLength=5)
    grammar = compile_schema({"type": "string", "pattern": "^é+$"})
    state = grammar.advance(grammar.start(), b'"\xc3')  # half a character: alive, it may become 'é'
    assert state is not None and grammar.advance(state, b"\xa8") is None  # 'è' is not
    assert grammar.advance(grammar.advance(state, b"\xa9"), b'\\u00E9"') is not None
    assert (
        grammar.advance(grammar.start(), b'"\\u00e') is not None and grammar.advance(grammar.start(), b'"\\u01') is None
    )
    assert grammar.advance(grammar.start(), b'"\xc2') is None  # no 'é' starts with that byte


def test_a_pattern_inside_a_schema_and_its_place_in_errors() -> None:
    schema = {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"}, "n": {"type": "integer"}},
        "required": ["date"],
    }
    grammar = compile_schema(schema)
    assert whole(grammar, b'{"date": "2024-01-31", "n": 3}') and not whole(grammar, b'{"date": "2024-1-31"}')
    assert grammar.advance(grammar.start(), b'{"date": "2024-1') is not None
    assert grammar.advance(grammar.start(), b'{"date": "2024-1-') is None  # refused at the first wrong character
    with pytest.raises(SchemaError, match=r"#/properties/d/pattern: pattern '\(a\)\\\\1': backreferences"):
        compile_schema({"type": "object", "properties": {"d": {"type": "string", "pattern": "(a)\\1"}}})


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("(?=a)b", "lookahead and lookbehind"),
        ("(?<!a)b", "lookahead and lookbehind"),
        ("\\bword", "word boundaries"),
        ("\\p{L}", "Unicode property"),
        ("a^b", "only at the start and end"),
        ("(^a)", "only at the start and end"),
        ("a**", "nothing to repeat"),
        ("*a", "nothing to repeat"),
        ("(ab", "without its ')'"),
        ("ab)", "unmatched ')'"),
        ("[ab", "without its ']'"),
        ("[z-a]", "out of order"),
        ("a{3,2}", "out of order"),
        ("\\", "cannot end with a backslash"),
        ("\\xZZ", "hexadecimal escape"),
        ("\\A", "not supported"),
        ("(a{100}){300}", "too large"),
        ("((){9999}){9999}", "too large"),
        ("(" * 500 + ")" * 500, "nest deeper than 100 levels"),
        (5, "must be a string"),
    ],
)
def test_patterns_it_cannot_follow_are_refused_with_why(pattern: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=re.escape(message)):
        compile_schema({"type": "string", "pattern": pattern})


def test_unsatisfiable_patterns_are_refused_and_bounds_count_characters() -> None:
    with pytest.raises(SchemaError, match="admits no finite document"):
        compile_schema({"type": "string", "pattern": "^a{5}$", "maxLength": 3})
    with pytest.raises(SchemaError, match="admits no finite document"):
        compile_schema({"type": "string", "pattern": "[]"})
    pattern = Pattern("^(ab)*$", 3, 5)  # even lengths only: 4
    state = (pattern.start, 0)
    for char in "abab":
        assert pattern.live(*state)
        state = pattern.step(*state, ord(char))  # type: ignore[assignment,misc]
        assert state is not None
    assert pattern.can_end(*state) and pattern.step(*state, ord("a")) is None  # 5 characters cannot end even


# Independent checks of each format the grammar makes answers follow (Python's own parsers where it has one).
def _hostname(text: str) -> bool:
    return len(text) <= 253 and all(0 < len(label) <= 63 for label in text.split("."))


FORMAT_CHECKS = {
    "date": datetime.date.fromisoformat,
    "time": datetime.time.fromisoformat,
    "date-time": datetime.datetime.fromisoformat,
    "uuid": uuid.UUID,
    "ipv4": ipaddress.IPv4Address,
    "email": lambda text: jsonschema.FormatChecker().conforms(text, "email") or 1 / 0,
    "hostname": lambda text: _hostname(text) or 1 / 0,
    "duration": lambda text: text.startswith("P") or 1 / 0,
}


@settings(max_examples=40, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(FORMATS)))
def test_strings_a_format_admits_parse_as_that_format(data: st.DataObject, name: str) -> None:
    """Every string the format's grammar takes (drawn from its pattern read by Python's ``re``) is whole for the
    grammar and parses with Python's own parser for the format."""
    assert sorted(FORMAT_CHECKS) == sorted(FORMATS)
    text = data.draw(st.from_regex(re.compile(FORMATS[name], re.ASCII), fullmatch=True))
    assert whole(compile_schema({"type": "string", "format": name}), json.dumps(text).encode()), text
    FORMAT_CHECKS[name](text)


@settings(max_examples=60, deadline=None)
@given(
    value=st.dates().map(lambda d: ("date", d.isoformat()))
    | st.datetimes().map(lambda t: ("date-time", t.isoformat() + "Z"))
    | st.times().map(lambda t: ("time", t.isoformat() + "+01:30"))
    | st.uuids().map(lambda u: ("uuid", str(u)))
    | st.ip_addresses(v=4).map(lambda a: ("ipv4", str(a)))
)
def test_values_written_by_pythons_own_formatters_are_admitted(value: tuple[str, str]) -> None:
    name, text = value
    assert whole(compile_schema({"type": "string", "format": name}), json.dumps(text).encode()), text


def test_formats_by_hand_and_a_pattern_before_its_format() -> None:
    def ok(name: str, text: str) -> bool:
        return whole(compile_schema({"type": "string", "format": name}), json.dumps(text).encode())

    assert ok("date", "2024-02-29") and ok("date", "2000-02-29") and not ok("date", "1900-02-29")
    assert not ok("date", "2023-02-29") and not ok("date", "2024-04-31") and not ok("date", "0000-01-01")
    assert ok("date-time", "2024-01-31T12:30:00.5+02:00") and not ok("date-time", "2024-01-31 12:30:00Z")
    assert ok("duration", "P3Y6M4DT12H30M5S") and ok("duration", "PT20M") and ok("duration", "P1W")
    assert not ok("duration", "P") and not ok("duration", "PT") and not ok("duration", "P1W2D")
    assert ok("email", "john.smith@mail.example.com") and not ok("email", "john@localhost")
    assert not ok("ipv4", "192.168.0.01") and ok("hostname", "a-b.example") and not ok("hostname", "a..b")
    assert ok("uri", "anything: an unsupported format stays an annotation")
    assert whole(compile_schema({"type": "string", "format": ["date"]}), b'"x"')  # not a format name: an annotation
    assert whole(compile_schema({"format": "date"}), b'"2024-01-31"') and not whole(
        compile_schema({"format": "date"}), b"1"
    )
    both = compile_schema({"type": "string", "format": "date", "pattern": "^x"})
    assert whole(both, b'"xyz"')  # with a pattern, the pattern alone


def test_a_pattern_that_needs_too_many_automaton_states_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from dartspec import json_pattern

    monkeypatch.setattr(json_pattern, "MAX_DFA_STATES", 40)
    automaton = Pattern("^(a|b)*a(a|b){6}$")  # 2^7 deterministic states as the answer walks them
    state: tuple[int, int] | None = (automaton.start, 0)
    with pytest.raises(json_pattern.PatternError, match="needs over 40 automaton states; simplify it"):
        for char in random.Random(0).choices("ab", k=200):
            assert state is not None
            state = automaton.step(*state, ord(char))


@settings(max_examples=200, deadline=None)
@given(pattern=patterns(), text=TEXTS)
def test_a_regex_answer_is_whole_exactly_when_python_matches_all_of_it(pattern: tuple[str, str], text: str) -> None:
    """``Grammar.regex`` (vLLM's guided_regex): plain text, not a JSON string (quotes, backslashes and line ends are
    characters like any other), the pattern matching all of it, anchored or not."""
    ecma, python = pattern
    expected = re.fullmatch(python, text) is not None
    try:
        grammar = Grammar.regex(ecma)
    except PatternError as err:  # refused only where no text matches
        assert "no text matches" in str(err) and not expected
        return
    assert whole(grammar, text.encode()) == expected, (ecma, text)
    if expected:
        state = grammar.start()
        for i, byte in enumerate(text.encode()):
            state = grammar.advance(state, bytes([byte]))
            assert state is not None, (ecma, text.encode()[: i + 1])


def test_choices_and_plain_text_regexes_by_hand() -> None:
    choice = Grammar.choice(["a.b", "(x)", "é", "a"])
    assert [whole(choice, t.encode()) for t in ["a.b", "(x)", "é", "a", "aXb", "a.", "(x", ""]] == [True] * 4 + [
        False
    ] * 4
    assert choice.advance(choice.start(), b"a") is not None and choice.advance(choice.start(), b"b") is None
    raw = Grammar.regex('say "(hi|yo)"\\\\\\n?')  # a quote, a backslash, a line end: characters of plain text
    assert whole(raw, b'say "hi"\\') and whole(raw, b'say "yo"\\\n') and not whole(raw, b'"say "hi"\\')
    assert whole(Grammar.regex("^\\s*(yes|no)$"), b"  yes")  # plain text may start with whitespace
    with pytest.raises(PatternError, match="no text matches the pattern"):
        Grammar.regex("a[]")
    for bad in ([], "yes", [1]):
        with pytest.raises(PatternError, match="a choice needs a non-empty list of strings"):
            Grammar.choice(bad)  # type: ignore[arg-type]
