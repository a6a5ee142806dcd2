"""An incremental recognizer of JSON text (RFC 8259) that follows a schema, byte by byte: which prefixes can still
become a document the schema admits.

A :class:`Grammar` is a table of nodes (compiled from a JSON Schema by :mod:`dartspec.json_schema`, or the two built in:
any JSON value, any JSON object): an object with its properties in order, an array, a string, a number, one exact
literal (``true``, an enum's value), alternatives, free text (only as the alternative to a whole document: a tool
call or a text answer), or plain text a regular expression matches whole (only as the whole answer:
:meth:`Grammar.regex`, :meth:`Grammar.choice`). A parse configuration is a small hashable tuple ``(frames, mode,
aux)``: ``frames`` the open containers innermost last, each ``(node, n, ...)`` (an object's next property index, an
array's items so far; a count and values where bounds need them), ``mode`` what the next byte may be and ``aux``
its detail. Alternatives that the bytes read have not told apart yet live side by side, so a :data:`State` is a
frozenset of configurations (almost always one).

:meth:`Grammar.advance` takes bytes and returns the state after them, or None as soon as no admitted document starts
with what was read; :meth:`Grammar.complete` says whether what was read is a whole one. The document starts at the
first byte (no whitespace before it) and nothing follows it (not even whitespace): a constrained answer starts and
ends where its value does, and a model cannot pad it forever. Between tokens whitespace is free, as JSON allows.

An object's properties come in the schema's order, each optional one possibly left out, the required ones never;
keys other than the named ones only where the schema allows them (after the named ones), as many as
``minProperties`` / ``maxProperties`` let it have. Strings take any byte from
0x20 up but ``"`` and ``\\`` (UTF-8 is the tokenizer's business: a multi-byte character split over tokens arrives in
pieces), control bytes only escaped; a length bound counts characters (an escape is one). A string with a ``pattern``
decodes its characters (escapes, UTF-8 split over tokens) and feeds them to the pattern's automaton
(:mod:`dartspec.json_pattern`). Numbers end at the first
byte that cannot extend them, which then counts as what follows the number (a number at the top level is complete
only at the end).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TypeAlias

from dartspec.json_numbers import NumberBounds
from dartspec.json_pattern import Pattern, PatternError, decode_step, utf8_step


@dataclass(frozen=True)
class Obj:
    """An object: ``props`` in order as (key as JSON text with its quotes, value node, required); ``extra``: the node
    of other keys' values (after the named ones), or None where no other key may come; ``min_props`` / ``max_props``
    bound how many keys it has. A bounded object's frame is ``(node, n, keys so far, other keys so far)``: the other
    keys (as read, no escapes) are kept while fewer than ``min_props`` keys are written, so that a repeated key (one
    property to a JSON parser) cannot count twice towards the minimum."""

    props: tuple[tuple[bytes, int, bool], ...] = ()
    extra: int | None = None
    min_props: int = 0
    max_props: int | None = None
    #: names (JSON text without quotes) no other key may be: properties whose values no document can be
    banned: tuple[bytes, ...] = ()
    #: the other keys where they are a list (``propertyNames`` an enum): each key as JSON text with its quotes, and the
    #: node of its value; ``extra`` is then unused. The frame keeps the ones written: none comes twice.
    literal_keys: tuple[tuple[bytes, int], ...] | None = None
    #: a string node every other key matches (``propertyNames`` / ``patternProperties``; no named key does), or None
    key: int | None = None

    @property
    def bounded(self) -> bool:
        """Whether the frame counts keys and keeps other keys (``(node, n, keys, others)``)."""
        return self.min_props > 0 or self.max_props is not None or self.literal_keys is not None

    @cached_property
    def names(self) -> frozenset[bytes]:
        """The keys (JSON text without quotes) no other key may be: the named ones and the banned ones."""
        return frozenset(key[1:-1] for key, _, _ in self.props) | frozenset(self.banned)

    @cached_property
    def required_from(self) -> tuple[int, ...]:
        """For each property index j (and the end), how many required properties come from j on."""
        counts = [0]
        for _, _, required in reversed(self.props):
            counts.append(counts[-1] + required)
        return tuple(reversed(counts))

    def fits(self, keys: int, n: int, used: int = 0) -> bool:
        """Whether ``keys`` keys written, with the named properties from ``n`` on still to come (and ``used`` of the
        listed other keys written), can end within the bounds: the required ones left do not pass the maximum, and
        enough keys may come for the minimum."""
        if self.max_props is not None and keys + self.required_from[n] > self.max_props:
            return False
        if self.literal_keys is not None:
            more = len(self.literal_keys) - used
        else:
            more = math.inf if self.extra is not None else 0
        return keys + len(self.props) - n + more >= self.min_props


@dataclass(frozen=True)
class Arr:
    """An array: its first items of the ``prefix`` nodes in turn (a tuple), the others of ``items``."""

    items: int
    min_items: int = 0
    max_items: int | None = None
    prefix: tuple[int, ...] = ()
    #: ``uniqueItems`` over items that are literals: (literal node, its value's id) pairs, equal JSON values one id;
    #: the array's frame then holds the ids used so far as its third element
    unique: tuple[tuple[int, int], ...] | None = None

    def item(self, n: int) -> int:
        """The node of the item at index ``n``."""
        return self.prefix[n] if n < len(self.prefix) else self.items

    @cached_property
    def value_of(self) -> dict[int, int]:
        """A unique array's literal nodes and their values' ids, as a mapping (made once)."""
        return dict(self.unique or ())

    @cached_property
    def values(self) -> int:
        """How many distinct values a unique array's items may take."""
        return len(set(self.value_of.values()))


@dataclass(frozen=True)
class Str:
    """A string; with ``pattern`` (which holds the same length bounds), one it matches."""

    min_length: int = 0
    max_length: int | None = None
    pattern: Pattern | None = None


@dataclass(frozen=True)
class Num:
    """A number; with ``bounds``, one inside them, written without an exponent."""

    integer: bool = False
    bounds: NumberBounds | None = None


@dataclass(frozen=True)
class Lit:
    """Exactly this JSON text (``true``, ``null``, an enum's or a const's value)."""

    text: bytes


@dataclass(frozen=True)
class Alt:
    options: tuple[int, ...]


@dataclass(frozen=True)
class Text:
    """Free text, not JSON: as an alternative to a document at the top, its first byte tells it apart (anything but
    ``{``, ``[`` or whitespace); then any bytes, and it may end anywhere (a tool call or a plain answer)."""


@dataclass(frozen=True)
class Regex:
    """Plain text (not JSON) that a regular expression matches whole, as the whole answer (vLLM's ``guided_regex``
    and ``guided_choice``): its UTF-8 characters go to ``pattern`` as they come, and it may end where that matches."""

    pattern: Pattern


Node: TypeAlias = Obj | Arr | Str | Num | Lit | Alt | Text | Regex
Config: TypeAlias = tuple[tuple[tuple[int, int], ...], int, object]
State: TypeAlias = frozenset[Config]

# Modes
START, VALUE, VALUE_OR_CLOSE, KEY_OR_CLOSE, KEY, COLON, AFTER, DONE = range(8)
STRING, ESCAPE, UNICODE, LITERAL, OTHER_KEY, FREE = range(8, 14)
MINUS, ZERO, INT, DOT, FRAC, EXP, EXP_SIGN, EXP_DIGITS = range(14, 22)
PATTERN = 22  # inside a string a pattern checks: aux is (node, pattern state, characters, bytes of a character so far,
# the value's node where the string is a key, else None)
RAW = 23  # plain text a regular expression checks (a Regex node): aux as for PATTERN

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
#: Number modes in which the number read so far is whole (it may still go on).
_NUMBER_ENDS = frozenset({ZERO, INT, FRAC, EXP_DIGITS})
_CLOSE = {Obj: 0x7D, Arr: 0x5D}  # '}', ']'
_PLAIN = re.compile(rb'[^"\\\x00-\x1f]*')  # bytes that just extend a string
_SPACE = re.compile(rb"[ \t\n\r]*")
_SPACED = frozenset({VALUE, VALUE_OR_CLOSE, KEY_OR_CLOSE, KEY, COLON, AFTER})  # modes whitespace leaves as they are


def leaves(nodes: Sequence[Node], roots: Sequence[int]) -> tuple[int, ...]:
    """The nodes other than alternatives a value of one of ``roots`` may be, in order (alternatives' cycles end)."""
    out: list[int] = []
    seen: set[int] = set()
    todo = list(reversed(roots))
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        n = nodes[i]
        if isinstance(n, Alt):
            todo.extend(reversed(n.options))
        else:
            out.append(i)
    return tuple(out)


def any_nodes(base: int = 0) -> list[Node]:
    """Any JSON value (node ``base``) and any object (node ``base + 1``), for a table where they start at ``base``."""
    kinds = [Obj(extra=base), Arr(base), Str(), Num(), Lit(b"true"), Lit(b"false"), Lit(b"null")]
    return [Alt(tuple(range(base + 1, base + 8))), *kinds]


class Grammar:
    """The documents a node table admits from its ``root``."""

    def __init__(self, nodes: Iterable[Node], root: int) -> None:
        self.nodes: tuple[Node, ...] = tuple(nodes)
        self.root = root
        # node -> first byte -> the nodes (other than alternatives) a value of it starting with that byte may be
        self._starts = [self._by_first_byte(self._expand(i)) for i in range(len(self.nodes))]

    def __repr__(self) -> str:
        root = self.nodes[self.root]
        if isinstance(root, Regex):
            return f"Grammar.regex({root.pattern.source!r})"
        return f"Grammar({len(self.nodes)} nodes)"

    @classmethod
    def any_value(cls) -> Grammar:
        return cls(any_nodes(), 0)

    @classmethod
    def any_object(cls) -> Grammar:
        """OpenAI's ``json_object``: any JSON object."""
        return cls(any_nodes(), 1)

    @classmethod
    def regex(cls, source: str) -> Grammar:
        """Plain text that the ECMA-262 regular expression ``source`` matches whole (:mod:`dartspec.json_pattern`;
        a :class:`~dartspec.json_pattern.PatternError` says what it cannot follow)."""
        pattern = Pattern(source, whole=True)
        if not pattern.live(pattern.start, 0):
            raise PatternError(f"no text matches the pattern {source!r}")
        return cls([Regex(pattern)], 0)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Grammar:
        """Exactly one of the strings ``options``, as plain text."""
        if isinstance(options, str) or not options or not all(isinstance(o, str) for o in options):
            raise PatternError(f"a choice needs a non-empty list of strings, got {options!r}")
        return cls.regex("|".join(re.sub(r"([\\^$.|?*+()\[\]{}/])", r"\\\1", o) for o in options))

    def _expand(self, node: int) -> tuple[int, ...]:
        return leaves(self.nodes, [node])

    def _by_first_byte(self, leaves: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
        out: dict[int, list[int]] = {}
        for leaf in leaves:
            n = self.nodes[leaf]
            if isinstance(n, Text):
                firsts = bytes(b for b in range(256) if b not in b"{[" and b not in _WS)
            elif isinstance(n, Regex):
                firsts = bytes(range(256))  # its pattern tells
            else:
                firsts = {Obj: b"{", Arr: b"[", Str: b'"', Num: b"-0123456789"}.get(type(n)) or n.text[:1]  # type: ignore[union-attr]
            for b in firsts:
                out.setdefault(b, []).append(leaf)
        return {b: tuple(leaves) for b, leaves in out.items()}

    def start(self) -> State:
        """The state before any byte."""
        return frozenset({((), START, self.root)})

    def complete(self, state: State) -> bool:
        """Whether the bytes read make a whole document."""
        return any(
            mode in (DONE, FREE)
            or (not frames and self._number_ends(mode, aux))
            or (mode == RAW and not aux[3] and self.nodes[aux[0]].pattern.can_end(aux[1], aux[2]))  # type: ignore[index, union-attr]
            or (mode == START and self._empty_text(aux))  # type: ignore[arg-type]
            for frames, mode, aux in state
        )

    def _empty_text(self, node: int) -> bool:
        """Whether ``node`` admits the empty answer (plain text a regular expression matches empty)."""
        for leaf in self._expand(node):
            n = self.nodes[leaf]
            if isinstance(n, Regex) and n.pattern.can_end(n.pattern.start, 0):
                return True
        return False

    def string_room(self, state: State) -> float | None:
        """Where every configuration is inside a string: how many more characters one of them takes (inf: no bound),
        each plain byte just extending it; else None."""
        room = 0.0
        for _, mode, aux in state:
            if mode == OTHER_KEY:  # a key being read: a plain byte always extends it
                return math.inf
            if mode != STRING:
                return None
            _, bound, length = aux  # type: ignore[misc]
            node = None if bound is None else self.nodes[bound]
            high = None if node is None else node.max_length  # type: ignore[union-attr]
            room = max(room, math.inf if high is None else high - length)
        return room

    def ascii_loop(self, state: State) -> int:
        """Where the state is one string a pattern checks, between characters: the ASCII characters that leave it as it
        is (:meth:`dartspec.json_pattern.Pattern.ascii_loop`); else 0."""
        if len(state) != 1:
            return 0
        ((_, mode, aux),) = state
        if mode not in (PATTERN, RAW) or aux[3]:  # type: ignore[index]
            return 0
        node, d = aux[0], aux[1]  # type: ignore[index]
        return self.nodes[node].pattern.ascii_loop(d)  # type: ignore[union-attr]

    def advance(self, state: State | None, data: bytes) -> State | None:
        """The state after ``data``, or None where no admitted document starts with the bytes read."""
        if state is None:
            return None
        configs: Iterable[Config] = state
        i, end = 0, len(data)
        while i < end:
            if len(configs) == 1:  # runs that leave a lone configuration as it is: string bytes, whitespace
                (config,) = configs
                mode = config[1]
                if mode == FREE:  # free text takes anything
                    return frozenset((config,))
                if mode == STRING and config[2][1] is None:  # type: ignore[index]
                    run = _PLAIN.match(data, i).end()  # type: ignore[union-attr]
                elif mode in _SPACED:
                    run = _SPACE.match(data, i).end()  # type: ignore[union-attr]
                else:
                    run = i
                if run > i:
                    i = run
                    continue
            nxt: list[Config] = []
            for config in configs:
                nxt.extend(self._step(config, data[i]))
            if not nxt:
                return None
            configs = nxt if len(nxt) == 1 else set(nxt)
            i += 1
        return configs if isinstance(configs, frozenset) else frozenset(configs)

    # One byte, one configuration: the configurations after it (none: refused).

    def _step(self, config: Config, b: int) -> list[Config]:
        frames, mode, aux = config
        if mode == STRING:
            return self._string(frames, aux, b)  # type: ignore[arg-type]
        if mode in (PATTERN, RAW):
            return self._pattern(frames, aux, b, raw=mode == RAW)  # type: ignore[arg-type]
        if mode == FREE:
            return [config]
        if mode == OTHER_KEY:
            return self._other_key(frames, aux, b)  # type: ignore[arg-type]
        if mode == LITERAL:
            rest, then = aux  # type: ignore[misc]
            if b != rest[0]:
                return []
            return [(frames, LITERAL, (rest[1:], then))] if len(rest) > 1 else [self._after_text(frames, then)]
        if mode >= MINUS:
            return self._number(frames, mode, aux, b)
        if mode == ESCAPE:
            if b == 0x75:  # 'u'
                return [(frames, UNICODE, (aux, 4))]
            return [(frames, STRING, aux)] if b in _ESCAPES else []
        if mode == UNICODE:
            string, left = aux  # type: ignore[misc]
            if b not in _HEX:
                return []
            return [(frames, STRING, string)] if left == 1 else [(frames, UNICODE, (string, left - 1))]
        if mode == START:  # the document's first byte (never whitespace, but where plain text may start with it)
            return self._value(frames, aux, b)  # type: ignore[arg-type]
        if b in _WS:
            return [] if mode == DONE else [config]
        if mode == VALUE:
            return self._value(frames, aux, b)  # type: ignore[arg-type]
        if mode == DONE:
            return []  # nothing may follow the document
        node, n = frames[-1][:2]
        top = self.nodes[node]
        if mode == AFTER:
            if b == 0x2C:  # ','
                if isinstance(top, Obj):
                    return [(frames, KEY, None)] if self._key(frames, top, n) else []
                assert isinstance(top, Arr)
                if top.max_items is not None and n >= top.max_items:
                    return []
                if top.unique is not None and len(frames[-1][2]) >= top.values:  # type: ignore[misc]
                    return []  # every value is in the array already
                return [(self._count(frames, top), VALUE, top.item(n))]
            return self._close(frames, top, n, b)
        if mode == VALUE_OR_CLOSE:
            assert isinstance(top, Arr)
            if b == 0x5D:
                return self._close(frames, top, n, b)
            if top.max_items == 0:
                return []
            return self._value(self._count(frames, top), top.item(n), b)
        if mode in (KEY_OR_CLOSE, KEY):
            assert isinstance(top, Obj)
            if b == 0x22:  # '"'
                return self._key(frames, top, n)
            return self._close(frames, top, n, b) if mode == KEY_OR_CLOSE else []
        if mode == COLON:
            return [(frames, VALUE, aux)] if b == 0x3A else []
        return []

    def _value(self, frames: tuple[tuple[int, int], ...], node: int, b: int) -> list[Config]:
        """The first byte of a value of ``node``."""
        out: list[Config] = []
        for leaf in self._starts[node].get(b, ()):
            n = self.nodes[leaf]
            if isinstance(n, Obj):
                frame = (leaf, 0, 0, frozenset()) if n.bounded else (leaf, 0)
                out.append(((*frames, frame), KEY_OR_CLOSE, None))
            elif isinstance(n, Arr):
                frame = (leaf, 0) if n.unique is None else (leaf, 0, frozenset())
                out.append(((*frames, frame), VALUE_OR_CLOSE, None))
            elif isinstance(n, Str) and n.pattern is not None:
                out.append((frames, PATTERN, (leaf, n.pattern.start, 0, b"", None)))
            elif isinstance(n, Str):
                bound = None if n.min_length == 0 and n.max_length is None else leaf
                out.append((frames, STRING, (None, bound, 0)))
            elif isinstance(n, Num):
                mode = MINUS if b == 0x2D else ZERO if b == 0x30 else INT
                if n.bounds is None:
                    out.append((frames, mode, n.integer))
                elif n.bounds.viable(bytes([b])):  # a bounded number carries its text so far
                    out.append((frames, mode, (n.integer, leaf, bytes([b]))))
            elif isinstance(n, Text):
                assert not frames, "free text is an alternative to the whole document only"
                out.append(((), FREE, None))
            elif isinstance(n, Regex):
                assert not frames, "a regular expression's text is the whole answer only"
                out.extend(self._pattern((), (leaf, n.pattern.start, 0, b"", None), b, raw=True))
            elif isinstance(n, Lit):
                held = self._unique_item(frames, leaf)
                if held is None:  # a value the unique array holds already
                    continue
                out.append(self._after_text(held, None) if len(n.text) == 1 else (held, LITERAL, (n.text[1:], None)))
        return out

    def _key(self, frames: tuple[tuple[int, int], ...], obj: Obj, n: int) -> list[Config]:
        """The opening quote of a key of an object at property ``n``: each named key from there on that skips only
        optional ones, and another key where the object takes them and no required one is left; within its bounds
        on the number of keys (none: no key may come here)."""
        out: list[Config] = []
        outer, frame = frames[:-1], frames[-1]
        node = frame[0]
        keys, others = (frame[2], frame[3]) if obj.bounded else (0, frozenset())  # type: ignore[misc]

        def at(j: int, kept: frozenset = others) -> tuple:  # the frame once the key is read; counts stop where the
            if not obj.bounded:  # bounds no longer tell them apart
                return (node, j)
            cap = obj.max_props if obj.max_props is not None else obj.min_props
            return (node, j, min(keys + 1, cap), kept)

        end = len(obj.props)
        for j in range(n, end):
            key, value, required = obj.props[j]
            if obj.fits(keys + 1, j + 1, len(others)):
                out.append(((*outer, at(j + 1)), LITERAL, (key[1:], value)))
            if required:
                break
        else:
            if obj.literal_keys is not None:  # each listed key not written yet
                for text, value in obj.literal_keys:
                    if text not in others and obj.fits(keys + 1, end, len(others) + 1):
                        out.append(((*outer, at(end, others | {text})), LITERAL, (text[1:], value)))
            elif obj.extra is not None and obj.fits(keys + 1, end):
                frames = (*outer, at(end))
                shape = None if obj.key is None else self.nodes[obj.key]
                if isinstance(shape, Str) and shape.pattern is not None:  # a key a pattern checks (none is named)
                    out.append((frames, PATTERN, (obj.key, shape.pattern.start, 0, b"", obj.extra)))
                elif isinstance(shape, Str) and (shape.min_length or shape.max_length is not None):
                    out.append((frames, STRING, (obj.extra, obj.key, 0)))  # a key of bounded length
                elif keys < obj.min_props:  # it must differ from the other keys so far: read whole
                    out.append((frames, OTHER_KEY, (obj.extra, b"", True)))
                elif obj.props or obj.banned:
                    out.append((frames, OTHER_KEY, (obj.extra, b"", False)))
                else:
                    out.append((frames, STRING, (obj.extra, None, 0)))
        return out

    def _close(self, frames: tuple[tuple[int, int], ...], top: Node, n: int, b: int) -> list[Config]:
        """The closing byte of the innermost container, where it may close (no required property left; enough
        items)."""
        if b != _CLOSE[type(top)]:
            return []
        if isinstance(top, Obj) and (top.required_from[n] or (top.bounded and frames[-1][2] < top.min_props)):  # type: ignore[misc]
            return []
        if isinstance(top, Arr) and n < top.min_items:
            return []
        return [self._after_text(frames[:-1], None)]

    @staticmethod
    def _count(frames: tuple[tuple[int, int], ...], arr: Arr) -> tuple[tuple[int, int], ...]:
        """The array frame with one more item; counts stop where neither a bound nor the prefix tells them apart (finite
        states)."""
        node, n = frames[-1][:2]
        cap = max(arr.max_items if arr.max_items is not None else arr.min_items, len(arr.prefix))
        return (*frames[:-1], (node, min(n + 1, cap), *frames[-1][2:]))

    def _unique_item(self, frames: tuple, leaf: int) -> tuple | None:
        """The frames once the literal ``leaf`` is an item of the innermost array where that array's items must be
        unique (its value now used), None where the array holds that value already; else ``frames`` as they are."""
        if not frames:
            return frames
        arr = self.nodes[frames[-1][0]]
        if not isinstance(arr, Arr) or arr.unique is None:
            return frames
        node, n, used = frames[-1]
        value = arr.value_of[leaf]
        return None if value in used else (*frames[:-1], (node, n, used | {value}))

    @staticmethod
    def _after_text(frames: tuple[tuple[int, int], ...], then: int | None) -> Config:
        """After a string or literal: a key's colon (``then``: its value's node), or the end of a value."""
        if then is not None:
            return (frames, COLON, then)
        return (frames, AFTER, None) if frames else ((), DONE, None)

    def _other_key(self, frames: tuple[tuple[int, int], ...], aux: tuple[int, bytes, bool], b: int) -> list[Config]:
        """A key other than the named ones: while what was read may still become a named key it is tracked (and takes
        no escape, which could spell one), then it is a plain string; read whole where it must differ from the object's
        other keys so far (``whole``: a bounded object short of its minimum), and then kept among them."""
        then, read, whole = aux
        obj: Obj = self.nodes[frames[-1][0]]  # type: ignore[assignment]
        names = obj.names
        if b == 0x22:
            if read in names:
                return []
            if whole:
                node, n, keys, others = frames[-1]  # type: ignore[misc]
                if read in others:
                    return []  # a repeated key: one property, not two
                others = frozenset() if keys >= obj.min_props else others | {read}  # enough keys: no need to tell
                frames = (*frames[:-1], (node, n, keys, others))
            return [(frames, COLON, then)]
        if b < 0x20 or b == 0x5C:
            return []
        read += bytes([b])
        if whole or any(name.startswith(read) for name in names):
            return [(frames, OTHER_KEY, (then, read, whole))]
        return [(frames, STRING, (then, None, 0))]

    def _string(self, frames: tuple[tuple[int, int], ...], aux: tuple[int | None, int | None, int], b: int) -> list:
        then, bound, length = aux
        if b == 0x22:
            if bound is not None and length < self.nodes[bound].min_length:  # type: ignore[union-attr]
                return []
            return [self._after_text(frames, then)]
        if b < 0x20:
            return []
        if bound is None or 0x80 <= b < 0xC0:  # unbounded, or a UTF-8 continuation byte: no new character
            return [(frames, ESCAPE if b == 0x5C else STRING, aux)]
        node: Str = self.nodes[bound]  # type: ignore[assignment]
        if node.max_length is not None and length >= node.max_length:
            return []
        cap = node.max_length if node.max_length is not None else node.min_length
        counted = (then, bound, min(length + 1, cap))
        return [(frames, ESCAPE if b == 0x5C else STRING, counted)]

    def _pattern(
        self,
        frames: tuple[tuple[int, int], ...],
        aux: tuple[int, int, int, bytes, int | None],
        b: int,
        raw: bool = False,
    ) -> list:
        """A byte of a string a pattern checks (``raw``: of plain text a Regex node checks): characters are decoded
        (a JSON string's escapes and UTF-8; plain text's UTF-8) and fed to the pattern, and a character read in part
        lives while one it may become keeps the string alive."""
        node, d, n, pending, then = aux
        pattern: Pattern = self.nodes[node].pattern  # type: ignore[union-attr, assignment]
        if b == 0x22 and not pending and not raw:
            return [self._after_text(frames, then)] if pattern.can_end(d, n) else []
        char = (utf8_step if raw else decode_step)(pending, b)
        if char is None:
            return []
        pending, low, high = char
        mode = RAW if raw else PATTERN
        if pending:
            return [(frames, mode, (node, d, n, pending, then))] if pattern.viable(d, n, low, high) else []
        after = pattern.step(d, n, low)
        return [] if after is None else [(frames, mode, (node, *after, b"", then))]

    def _number_ends(self, mode: int, aux: object) -> bool:
        """Whether a number read so far is whole (and inside its bounds)."""
        if mode not in _NUMBER_ENDS:
            return False
        if isinstance(aux, tuple):
            _, node, text = aux
            return self.nodes[node].bounds.admits(text)  # type: ignore[union-attr]
        return True

    def _number(self, frames: tuple[tuple[int, int], ...], mode: int, aux: object, b: int) -> list[Config]:
        bounded = isinstance(aux, tuple)
        integer = aux[0] if bounded else bool(aux)  # type: ignore[index]
        digit = b in _DIGITS
        if mode == MINUS:
            nxt = (ZERO if b == 0x30 else INT) if digit else None
        elif mode in (DOT, EXP_SIGN):
            nxt = (FRAC if mode == DOT else EXP_DIGITS) if digit else None
        elif mode == EXP:
            nxt = EXP_SIGN if b in (0x2B, 0x2D) else EXP_DIGITS if digit else None
        elif digit and mode != ZERO:  # ZERO, INT, FRAC, EXP_DIGITS: the number is whole; it goes on or ends here
            nxt = mode
        elif not integer and b == 0x2E and mode in (ZERO, INT):  # '.'
            nxt = DOT
        elif not integer and not bounded and b in (0x65, 0x45) and mode != EXP_DIGITS:  # 'e', 'E'
            nxt = EXP
        else:  # the number ended before this byte, which counts as what follows it
            if not frames or not self._number_ends(mode, aux):
                return []  # a top-level number: nothing may follow it
            return self._step((frames, AFTER, None), b)
        if nxt is None:
            return []
        if not bounded:
            return [(frames, nxt, integer)]
        _, node, text = aux  # type: ignore[misc]
        text += bytes([b])
        return [(frames, nxt, (integer, node, text))] if self.nodes[node].bounds.viable(text) else []  # type: ignore[union-attr]
