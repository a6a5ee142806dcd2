"""JSON Schema's ``pattern``: an ECMA-262 regular expression as an automaton over a string's characters, so that a
constrained answer's string can be checked character by character, and every prefix kept only while some way to
finish it still matches.

A pattern matches anywhere in the string (as JSON Schema says) unless it is anchored: ``^`` at the start and ``$`` at
the end of the pattern or of one of its top-level alternatives; an anchor anywhere else is refused. Supported: literal
characters, ``.``, classes (``[a-z]``, ``[^"]``, ``\\d \\w \\s`` and their complements, ASCII as in ECMA-262 without
the ``u`` flag), escapes (``\\n``, ``\\t``, ``\\xHH``, ``\\uHHHH``, ``\\u{...}``, ``\\cX``, ``\\/`` ...), groups
(``(...)``, ``(?:...)``, ``(?<name>...)``), alternation and the quantifiers ``* + ? {n} {n,} {n,m}`` (lazy or not: the
language is the same). Refused, with what and where: backreferences, lookarounds, word boundaries and Unicode
properties. The automaton is a Thompson NFA made deterministic lazily (only the states an answer reaches), over
Unicode scalar values (a surrogate is no character). Length bounds (``minLength`` / ``maxLength``) go in the same
check: a state lives while some completion reaches a match with a length inside them.
"""

from __future__ import annotations

import functools
import operator
from bisect import bisect_right
from itertools import pairwise
from typing import TypeAlias

from dartspec.errors import DartspecError

#: Inclusive code point ranges, sorted and apart.
Ranges: TypeAlias = tuple[tuple[int, int], ...]
#: Unicode scalar values: every code point but the surrogates.
UNIVERSE: Ranges = ((0, 0xD7FF), (0xE000, 0x10FFFF))
#: NFA states a pattern may take (bounded repeats are copies), deterministic states it may reach (made as an answer
#: needs them; each holds a set of NFA states, so this bounds a request's memory), and bits of length bookkeeping.
MAX_STATES = 20_000
MAX_DFA_STATES = 50_000
#: Groups a pattern may nest (the parser and the builder recurse).
MAX_NESTING = 100
MAX_LENGTH_BITS = 20_000_000

_DIGIT: Ranges = ((0x30, 0x39),)
_WORD: Ranges = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE: Ranges = (
    (0x09, 0x0D),
    (0x20, 0x20),
    (0xA0, 0xA0),
    (0x1680, 0x1680),
    (0x2000, 0x200A),
    (0x2028, 0x2029),
    (0x202F, 0x202F),
    (0x205F, 0x205F),
    (0x3000, 0x3000),
    (0xFEFF, 0xFEFF),
)
_LINE_ENDS: Ranges = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
_CONTROL = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B}
#: JSON's one-letter escapes, as the code point each stands for.
JSON_ESCAPES = {0x22: 0x22, 0x5C: 0x5C, 0x2F: 0x2F, 0x62: 0x08, 0x66: 0x0C, 0x6E: 0x0A, 0x72: 0x0D, 0x74: 0x09}
_HEX = frozenset(b"0123456789abcdefABCDEF")
_UTF8_LOW = {2: 0x80, 3: 0x800, 4: 0x10000}  # the smallest code point of each encoded length (no overlong forms)


class PatternError(DartspecError):
    """A pattern this module cannot follow (the message says what, and where in the pattern)."""


def merge(ranges: list[tuple[int, int]] | Ranges) -> Ranges:
    """``ranges`` sorted, joined where they touch, and cut to :data:`UNIVERSE`."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple(
        (max(lo, ulo), min(hi, uhi)) for lo, hi in out for ulo, uhi in UNIVERSE if max(lo, ulo) <= min(hi, uhi)
    )


def complement(ranges: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in merge(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= 0x10FFFF:
        out.append((nxt, 0x10FFFF))
    return merge(out)


# The parse tree: ("chars", Ranges), ("cat", [...]), ("alt", [...]), ("rep", node, low, high | None), ("bol",),
# ("eol",).
Syntax: TypeAlias = tuple


def shown(source: str) -> str:
    """A pattern as an error message quotes it (a long one cut)."""
    return repr(source if len(source) <= 80 else source[:77] + "...")


class _Parser:
    """Recursive descent over ECMA-262's pattern grammar (the subset above), to a :data:`Syntax` tree."""

    def __init__(self, source: str) -> None:
        self.src = source
        self.i = 0
        self.depth = 0

    def fail(self, what: str, at: int | None = None) -> PatternError:
        at = self.i if at is None else at
        return PatternError(f"pattern {shown(self.src)}: {what} (at character {at})")

    def peek(self, k: int = 0) -> str:
        return self.src[self.i + k] if self.i + k < len(self.src) else ""

    def parse(self) -> Syntax:
        tree = self.alternation()
        if self.i < len(self.src):
            raise self.fail("unmatched ')'")
        return tree

    def alternation(self) -> Syntax:
        options = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self) -> Syntax:
        parts = []
        while self.peek() not in ("", "|", ")"):
            parts.append(self.quantified())
        return ("cat", parts)

    def quantified(self) -> Syntax:
        start = self.i
        atom = self.atom()
        bounds = self.quantifier()
        if bounds is None:
            return atom
        if atom[0] in ("bol", "eol"):
            raise self.fail("an anchor cannot be repeated", start)
        if self.quantifier() is not None:
            raise self.fail("nothing to repeat")
        return ("rep", atom, *bounds)

    def quantifier(self) -> tuple[int, int | None] | None:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            bounds = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        else:
            bounds = self.braces()
            if bounds is None:
                return None
        if self.peek() == "?":  # lazy: the same strings
            self.i += 1
        return bounds

    def braces(self) -> tuple[int, int | None] | None:
        """``{n}``, ``{n,}`` or ``{n,m}`` here (advancing past it), else None (a ``{`` is then a literal)."""
        j = self.i
        if self.peek() != "{":
            return None
        end = self.src.find("}", j)
        body = self.src[j + 1 : end] if end > 0 else ""
        low, comma, high = body.partition(",")
        if not low.isdigit() or not (high.isdigit() or high == "") or not low.isascii() or not high.isascii():
            return None
        self.i = end + 1
        bounds = (int(low), int(high) if high else (None if comma else int(low)))
        if bounds[1] is not None and bounds[1] < bounds[0]:
            raise self.fail("a repeat's bounds are out of order", j)
        return bounds

    def atom(self) -> Syntax:
        c = self.peek()
        start = self.i
        self.i += 1
        if c == "(":
            if self.peek() == "?":
                if self.src.startswith("?:", self.i):
                    self.i += 2
                elif self.peek(1) == "<" and self.peek(2) not in ("=", "!"):
                    end = self.src.find(">", self.i)
                    if end < 0:
                        raise self.fail("a group name without its '>'", start)
                    self.i = end + 1
                else:
                    raise self.fail("lookahead and lookbehind are not supported", start)
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise self.fail(f"groups nest deeper than {MAX_NESTING} levels", start)
            inner = self.alternation()
            self.depth -= 1
            if self.peek() != ")":
                raise self.fail("a '(' without its ')'", start)
            self.i += 1
            return inner
        if c == "[":
            return ("chars", self.char_class(start))
        if c == ".":
            return ("chars", complement(_LINE_ENDS))
        if c == "^":
            return ("bol",)
        if c == "$":
            return ("eol",)
        if c == "\\":
            return ("chars", self.escape(in_class=False))
        if c in ("*", "+", "?") or (c == "{" and self.braces_at(start)):
            raise self.fail("nothing to repeat", start)
        return ("chars", merge([(ord(c), ord(c))]))

    def braces_at(self, at: int) -> bool:
        saved, self.i = self.i, at
        try:
            return self.braces() is not None
        finally:
            self.i = saved

    def escape(self, in_class: bool) -> Ranges:
        """The characters of an escape (after its backslash)."""
        start = self.i - 1
        c = self.peek()
        if not c:
            raise self.fail("a pattern cannot end with a backslash", start)
        self.i += 1
        sets = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
        if c.lower() in sets:
            chars = merge(sets[c.lower()])
            return complement(chars) if c.isupper() else chars
        if c == "b" and in_class:
            return ((0x08, 0x08),)
        if c in ("b", "B"):
            raise self.fail("word boundaries (\\b, \\B) are not supported", start)
        if c.isdigit() and c != "0":
            raise self.fail("backreferences are not supported", start)
        if c == "k" and self.peek() == "<":
            raise self.fail("backreferences are not supported", start)
        if c in ("p", "P") and self.peek() == "{":
            raise self.fail("Unicode property escapes are not supported", start)
        code = self.char_escape(c, start)
        return merge([(code, code)])

    def char_escape(self, c: str, start: int) -> int:
        if c in _CONTROL:
            return _CONTROL[c]
        if c == "0" and not self.peek().isdigit():
            return 0
        if c == "c" and self.peek().isascii() and self.peek().isalpha():
            self.i += 1
            return ord(self.src[self.i - 1]) % 32
        if c == "x":
            return self.hex_digits(2, start)
        if c == "u":
            if self.peek() == "{":
                end = self.src.find("}", self.i)
                digits = self.src[self.i + 1 : end] if end > 0 else ""
                if not digits or any(d not in "0123456789abcdefABCDEF" for d in digits) or int(digits, 16) > 0x10FFFF:
                    raise self.fail("a bad \\u{...} escape", start)
                self.i = end + 1
                return int(digits, 16)
            return self.hex_digits(4, start)
        if c.isalnum():
            raise self.fail(f"the escape \\{c} is not supported", start)
        return ord(c)  # an escaped punctuation character stands for itself

    def hex_digits(self, n: int, start: int) -> int:
        digits = self.src[self.i : self.i + n]
        if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
            raise self.fail("a bad hexadecimal escape", start)
        self.i += n
        return int(digits, 16)

    def char_class(self, start: int) -> Ranges:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        items: list[tuple[int, int]] = []
        while self.peek() != "]":
            if not self.peek():
                raise self.fail("a '[' without its ']'", start)
            low = self.class_atom()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                high = self.class_atom()
                if len(low) != 1 or len(high) != 1 or low[0][0] != low[0][1] or high[0][0] != high[0][1]:
                    raise self.fail("a class range must join two single characters", start)
                if high[0][0] < low[0][0]:
                    raise self.fail("a class range is out of order", start)
                items.append((low[0][0], high[0][0]))
            else:
                items.extend(low)
        self.i += 1
        chars = merge(items)
        return complement(chars) if negate else chars

    def class_atom(self) -> Ranges:
        c = self.peek()
        self.i += 1
        if c == "\\":
            return self.escape(in_class=True)
        return ((ord(c), ord(c)),) if not 0xD800 <= ord(c) <= 0xDFFF else ()


def _unanchor(tree: Syntax, source: str, whole: bool) -> Syntax:
    """The pattern as a whole-string match: each top-level alternative not anchored at an end gets any characters
    there (unless ``whole``: the pattern must match all of the string, anchored or not). Anchors elsewhere are
    refused."""
    anything: Syntax = ("rep", ("chars", UNIVERSE), 0, None)
    options = tree[1] if tree[0] == "alt" else [tree]
    out = []
    for option in options:
        parts = list(option[1]) if option[0] == "cat" else [option]
        anchored = bool(parts) and parts[0] == ("bol",)
        head = [] if anchored or whole else [anything]
        parts = parts[1:] if anchored else parts
        anchored = bool(parts) and parts[-1] == ("eol",)
        tail = [] if anchored or whole else [anything]
        parts = parts[:-1] if anchored else parts
        if _has_anchor(("cat", parts)):
            raise PatternError(
                f"pattern {shown(source)}: '^' and '$' are supported only at the start and end of the pattern "
                "(or of its top-level alternatives)"
            )
        out.append(("cat", [*head, *parts, *tail]))
    return ("alt", out)


def _has_anchor(tree: Syntax) -> bool:
    kind = tree[0]
    if kind in ("bol", "eol"):
        return True
    if kind in ("cat", "alt"):
        return any(_has_anchor(t) for t in tree[1])
    if kind == "rep":
        return _has_anchor(tree[1])
    return False


class _Nfa:
    """A Thompson NFA: epsilon moves and character-range moves per state; ``accept`` the one final state."""

    def __init__(self, tree: Syntax, source: str) -> None:
        self.source = source
        self.eps: list[list[int]] = []
        self.moves: list[list[tuple[Ranges, int]]] = []
        self.work = 0  # pieces built: empty ones add no state, yet repeating them must still end
        self.start = self.new()
        self.accept = self.build(tree, self.start)

    def new(self) -> int:
        if len(self.eps) >= MAX_STATES:
            raise PatternError(
                f"pattern {shown(self.source)} is too large (its automaton has over {MAX_STATES} states)"
            )
        self.eps.append([])
        self.moves.append([])
        return len(self.eps) - 1

    def build(self, tree: Syntax, start: int) -> int:
        """Adds ``tree`` from state ``start``; returns its end state."""
        self.work += 1
        if self.work > 4 * MAX_STATES:
            raise PatternError(f"pattern {shown(self.source)} is too large (it repeats too many pieces)")
        kind = tree[0]
        if kind == "chars":
            end = self.new()
            if tree[1]:  # an empty class matches nothing: no move
                self.moves[start].append((tree[1], end))
            return end
        if kind == "cat":
            for part in tree[1]:
                start = self.build(part, start)
            return start
        if kind == "alt":
            end = self.new()
            for option in tree[1]:
                begin = self.new()
                self.eps[start].append(begin)
                self.eps[self.build(option, begin)].append(end)
            return end
        _, body, low, high = tree
        for _ in range(low):
            start = self.build(body, start)
        if high is None:  # a loop: its entry is its exit
            loop = self.new()
            self.eps[start].append(loop)
            self.eps[self.build(body, loop)].append(loop)
            return loop
        end = self.new()
        self.eps[start].append(end)
        for _ in range(high - low):
            start = self.build(body, start)
            self.eps[start].append(end)
        return end

    def closure(self, states: set[int]) -> frozenset[int]:
        todo, seen = list(states), set(states)
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)


class Pattern:
    """A pattern with a string's length bounds: which character sequences can still become a matching string.

    A state is ``(d, n)``: ``d`` a deterministic state's id (a set of NFA states, made on first need), ``n`` the
    characters so far, capped where the bounds no longer tell counts apart.
    """

    def __init__(self, source: str, min_length: int = 0, max_length: int | None = None, whole: bool = False) -> None:
        if not isinstance(source, str):
            raise PatternError(f"a pattern must be a string, got {type(source).__name__}")
        self.source, self.min_length, self.max_length, self.whole = source, min_length, max_length, whole
        self._nfa = _Nfa(_unanchor(_Parser(source).parse(), source, whole), source)
        self._cap = max_length if max_length is not None else min_length
        self._reach = self._lengths_to_accept()
        self._sets: list[frozenset[int]] = []
        self._masks: list[int] = []  # per deterministic state, its NFA states' length masks joined (made once)
        self._ids: dict[frozenset[int], int] = {}
        self._steps: dict[int, tuple[list[int], list[int], list[int]]] = {}  # d -> interval starts, ends, targets
        self.start = self._id(self._nfa.closure({self._nfa.start}))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pattern) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Pattern({self.source!r}, {self.min_length}, {self.max_length})"

    def _key(self) -> tuple[str, int, int | None, bool]:
        return self.source, self.min_length, self.max_length, self.whole

    def _lengths_to_accept(self) -> list[int]:
        """Per NFA state, a bit mask of the character counts with which it can reach the accepting state: bit k for
        exactly k (k < C), bit C for C or more, where C is past both bounds (a backward fixpoint)."""
        nfa = self._nfa
        top = 1 << (max(self.min_length, self.max_length or 0) + 1)
        if top.bit_length() * len(nfa.eps) > MAX_LENGTH_BITS:
            raise PatternError(
                f"pattern {shown(self.source)}: its length bounds are too large to follow with a pattern"
            )
        full = (top << 1) - 1
        eps_from: list[list[int]] = [[] for _ in nfa.eps]
        char_from: list[list[int]] = [[] for _ in nfa.eps]
        for s, targets in enumerate(nfa.eps):
            for t in targets:
                eps_from[t].append(s)
        for s, moves in enumerate(nfa.moves):
            for _, t in moves:
                char_from[t].append(s)
        reach = [0] * len(nfa.eps)
        reach[nfa.accept] = 1
        todo = [nfa.accept]
        while todo:
            t = todo.pop()
            for sources, mask in ((eps_from[t], reach[t]), (char_from[t], ((reach[t] << 1) & full) | (reach[t] & top))):
                for s in sources:
                    if reach[s] | mask != reach[s]:
                        reach[s] |= mask
                        todo.append(s)
        return reach

    def _id(self, states: frozenset[int]) -> int:
        if states not in self._ids:
            if len(self._sets) >= MAX_DFA_STATES:
                raise PatternError(
                    f"pattern {shown(self.source)} needs over {MAX_DFA_STATES} automaton states; simplify it"
                )
            self._ids[states] = len(self._sets)
            self._sets.append(states)
            self._masks.append(functools.reduce(operator.or_, (self._reach[s] for s in states), 0))
        return self._ids[states]

    def _intervals(self, d: int) -> tuple[list[int], list[int], list[int]]:
        """The deterministic moves out of ``d``: code point intervals (starts, ends) and the state each leads to."""
        if d not in self._steps:
            moves = [(ranges, t) for s in self._sets[d] for ranges, t in self._nfa.moves[s]]
            cuts = sorted({lo for ranges, _ in moves for lo, _ in ranges} | {hi + 1 for r, _ in moves for _, hi in r})
            starts: list[int] = []
            ends: list[int] = []
            targets: list[int] = []
            for lo, nxt in pairwise(cuts):
                hit = {t for ranges, t in moves if any(a <= lo <= b for a, b in ranges)}
                if not hit:
                    continue
                target = self._id(self._nfa.closure(hit))
                if targets and targets[-1] == target and ends[-1] == lo - 1:
                    ends[-1] = nxt - 1
                else:
                    starts.append(lo)
                    ends.append(nxt - 1)
                    targets.append(target)
            self._steps[d] = (starts, ends, targets)
        return self._steps[d]

    def ascii_loop(self, d: int) -> int:
        """The ASCII characters that leave ``d`` as it is, as a 128-bit mask (0 where lengths are bounded: there each
        character counts). A run of them keeps a string alive where ``d`` lives: a shortcut for whole-vocabulary
        checks, where most tokens are such runs."""
        if self.min_length or self.max_length is not None:
            return 0
        starts, ends, targets = self._intervals(d)
        mask = 0
        for lo, hi, target in zip(starts, ends, targets, strict=True):
            if target == d and lo < 0x80:
                mask |= ((1 << (min(hi, 0x7F) + 1)) - 1) & ~((1 << lo) - 1)
        return mask

    def live(self, d: int, n: int) -> bool:
        """Whether some completion of ``n`` characters in state ``d`` matches within the length bounds."""
        mask = self._masks[d]
        low = max(self.min_length - n, 0)
        if self.max_length is None:
            return mask >> low != 0
        high = self.max_length - n
        return high >= low and (mask >> low) & ((1 << (high - low + 1)) - 1) != 0

    def can_end(self, d: int, n: int) -> bool:
        """Whether the characters read make a matching string within the bounds."""
        return self._nfa.accept in self._sets[d] and n >= self.min_length

    def step(self, d: int, n: int, code: int) -> tuple[int, int] | None:
        """The state after the character ``code``, or None where no matching string goes on this way."""
        starts, ends, targets = self._intervals(d)
        k = bisect_right(starts, code) - 1
        if k < 0 or code > ends[k]:
            return None
        after = (targets[k], min(n + 1, self._cap) if self.max_length is None else n + 1)
        return after if self.live(*after) else None

    def matches(self, text: str) -> bool:
        """Whether the pattern (with its length bounds) matches the whole of ``text``, read from the start."""
        state: tuple[int, int] | None = (self.start, 0)
        for char in text:
            state = self.step(*state, ord(char))
            if state is None:
                return False
        return self.can_end(*state)

    def completion(self, d: int, n: int) -> str | None:
        """A shortest string that, read from state ``(d, n)``, ends a match within the bounds (None: there is none);
        a witness that the state lives."""
        todo, seen, i = [(d, n, "")], {(d, n)}, 0
        while i < len(todo):
            d, n, text = todo[i]
            i += 1
            if self.can_end(d, n):
                return text
            for code in self._intervals(d)[0]:  # one character of each move
                after = self.step(d, n, code)
                if after is not None and after not in seen:
                    seen.add(after)
                    todo.append((*after, text + chr(code)))
        return None

    def viable(self, d: int, n: int, low: int, high: int) -> bool:
        """Whether some character in ``low..high`` keeps the string alive (a character read only in part)."""
        starts, ends, targets = self._intervals(d)
        after = min(n + 1, self._cap) if self.max_length is None else n + 1
        k = max(bisect_right(starts, low) - 1, 0)
        while k < len(starts) and starts[k] <= high:
            if ends[k] >= low and self.live(targets[k], after):
                return True
            k += 1
        return False


def utf8_step(pending: bytes, b: int) -> tuple[bytes, int, int] | None:
    """One byte of raw UTF-8 text (``pending``: a character's bytes read so far), as :func:`decode_step` says."""
    if not pending:
        if b < 0x80:
            return b"", b, b
        return _utf8(bytes([b])) if 0xC2 <= b <= 0xF4 else None
    return _utf8(pending + bytes([b])) if 0x80 <= b < 0xC0 else None


def decode_step(pending: bytes, b: int) -> tuple[bytes, int, int] | None:
    """One byte of a JSON string's character (``pending``: the bytes of an escape or a UTF-8 sequence read so far):
    ``(pending, low, high)``, the bytes still open and the code points they may become (``pending`` empty: the
    character ``low`` is whole), or None where the byte cannot go on (a control byte, a bad escape or UTF-8). The
    closing quote is the caller's."""
    if not pending:
        if b < 0x20:
            return None
        if b == 0x5C:
            return b"\\", 0, 0xFFFF
        return utf8_step(pending, b)
    if pending[0] == 0x5C:
        if len(pending) == 1:
            if b == 0x75:  # 'u'
                return b"\\u", 0, 0xFFFF
            code = JSON_ESCAPES.get(b)
            return None if code is None else (b"", code, code)
        if b not in _HEX:
            return None
        digits = pending[2:] + bytes([b])
        value = int(digits, 16)
        if len(digits) == 4:
            return b"", value, value
        spread = 16 ** (4 - len(digits))
        return pending + bytes([b]), value * spread, value * spread + spread - 1
    return utf8_step(pending, b)


def _utf8(read: bytes) -> tuple[bytes, int, int] | None:
    """The code points a UTF-8 sequence begun with ``read`` may be (no overlong forms, none past U+10FFFF)."""
    lead = read[0]
    need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    value = lead & (0x1F, 0x0F, 0x07)[need - 2]
    for c in read[1:]:
        value = value << 6 | (c & 0x3F)
    left = need - len(read)
    low = max(value << (6 * left), _UTF8_LOW[need])
    high = min((value << (6 * left)) + (1 << (6 * left)) - 1, 0x10FFFF)
    if low > high:
        return None
    return (b"", low, low) if left == 0 else (read, low, high)
