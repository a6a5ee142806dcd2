"""The JSON recognizer against Python's own parser: every prefix of a document lives, whole documents are complete,
and on arbitrary text it accepts exactly what ``json.loads`` parses (no trailing whitespace)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from dartspec import json_grammar as jg

ANY = jg.Grammar.any_value()
OBJECT = jg.Grammar.any_object()

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


def assert_judged_as_json_loads_judges(text: str) -> jg.State | None:
    """The recognizer finds ``text`` a whole document exactly when ``json.loads`` parses it (less trailing
    whitespace around it, which it does not take); returns its state."""
    state = ANY.advance(ANY.start(), text.encode())
    try:
        strict_loads(text)
        parses = text == text.strip(" \t\n\r")
    except ValueError:
        parses = False
    assert (state is not None and ANY.complete(state)) == parses, text
    return state


def strict_loads(text: str) -> object:
    def refuse(name: str) -> None:
        raise ValueError(name)

    return json.loads(text, parse_constant=refuse)


@settings(max_examples=300, deadline=None)
@given(value=values, indent=st.sampled_from([None, 0, 2]), ascii_only=st.booleans(), lead=st.sampled_from(["", " \n"]))
def test_every_prefix_of_a_document_lives_and_only_the_whole_is_complete(
    value: object, indent: int | None, ascii_only: bool, lead: str
) -> None:
    data = json.dumps(value, indent=indent, ensure_ascii=ascii_only).encode()
    state: jg.State | None = ANY.start()
    for i, byte in enumerate(data):
        state = ANY.advance(state, bytes([byte]))
        assert state is not None, data[: i + 1]
    assert ANY.complete(state)
    assert ANY.advance(state, b" ") is None and ANY.advance(state, b",") is None  # nothing after the document
    whole = OBJECT.advance(OBJECT.start(), data)
    assert (whole is not None and OBJECT.complete(whole)) == isinstance(value, dict)
    assert lead == "" or ANY.advance(ANY.start(), lead.encode() + data) is None  # the value comes first


ALPHABET = st.sampled_from([*'{}[]",:. \n-+0123456789eEtrufalsn\\/bu"x\x01', "true", "null", "1e5", '"a"'])


@settings(max_examples=1500, deadline=None)
@given(parts=st.lists(ALPHABET, max_size=14))
def test_on_any_text_it_accepts_what_json_loads_parses(parts: list[str]) -> None:
    text = "".join(parts)
    state = assert_judged_as_json_loads_judges(text)
    if state is not None:  # a live prefix is a prefix of some document: closing what is open parses
        assert _closes(state, text)


@settings(max_examples=800, deadline=None)
@given(value=values, data=st.data())
def test_near_misses_of_documents_are_judged_as_json_loads_judges_them(value: object, data: st.DataObject) -> None:
    """A document with one character inserted, deleted or replaced: subtle errors (a leading zero, a lone minus, a
    missing comma, an unfinished escape) that random text rarely makes."""
    text = json.dumps(value)
    at = data.draw(st.integers(0, len(text)))
    char = data.draw(st.sampled_from(list('{}[]",:.-+0eE \\u1a\x1f')))
    edit = data.draw(st.sampled_from(["insert", "delete", "replace"]))
    assert_judged_as_json_loads_judges(text[:at] + (char if edit != "delete" else "") + text[at + (edit != "insert") :])


def _closes(state: jg.State, text: str) -> bool:
    """Some completion of a live prefix parses (a constructive witness per mode, from any one configuration)."""
    frames, mode, aux = min(state, key=repr)
    key = ""
    if mode in (jg.STRING, jg.ESCAPE, jg.UNICODE):
        string = aux[0] if mode == jg.UNICODE else aux  # type: ignore[index]
        key = ":0" if string[0] is not None else ""  # type: ignore[index]
    tail = {
        jg.START: "0",
        jg.VALUE: "0",
        jg.KEY: '"k":0',
        jg.COLON: ":0",
        jg.STRING: '"' + key,
        jg.ESCAPE: 'n"' + key,
        jg.MINUS: "1",
        jg.DOT: "1",
        jg.EXP: "1",
        jg.EXP_SIGN: "1",
    }.get(mode, "")
    if mode == jg.UNICODE:
        tail = "0" * aux[1] + '"' + key  # type: ignore[index]
    if mode == jg.LITERAL:
        rest, then = aux  # type: ignore[misc]
        tail = rest.decode() + (":0" if then is not None else "")
    closing = "".join("}" if isinstance(ANY.nodes[node], jg.Obj) else "]" for node, _ in reversed(frames))
    try:
        strict_loads(text + tail + closing)
    except ValueError:
        return False
    return True


TRICKY = [
    '{"a": 1,}',
    "[1,]",
    "[,1]",
    "{,}",
    '{"a"}',
    '{"a":}',
    '{"a" 1}',
    '{"a":1 "b":2}',
    "01",
    "-",
    "-0",
    "1.",
    ".5",
    "1e",
    "1e+",
    "1E-7",
    "-01",
    "0.0e0",
    '"\\x"',
    '"\\u12"',
    '"\\u12af"',
    '"\\/"',
    "tru",
    "true",
    "nul",
    "[]",
    "{}",
    "[[]]",
    '{"":[{}]}',
    "[1 2]",
    '"a\tb"',
    '"a\\tb"',
    "[1]]",
    "{}}",
    " {} ",
    " {}",
    "1 ",
    "[-]",
    "[1e5,-2.5E-3]",
]


def test_tricky_texts_are_judged_as_json_loads_judges_them() -> None:
    for text in TRICKY:
        assert_judged_as_json_loads_judges(text)
