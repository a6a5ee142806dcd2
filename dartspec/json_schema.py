"""JSON Schema to a :class:`~dartspec.json_grammar.Grammar`: the subset a constrained answer can follow byte by byte.

Supported: ``type`` (one or a list), ``properties`` / ``required`` / ``additionalProperties``, ``minProperties`` /
``maxProperties`` (a repeated key counts once, as a JSON parser reads it), ``propertyNames`` (a list of names, or a
string schema for the other keys), ``patternProperties`` (one pattern for the other keys, or any where
``propertyNames`` lists the names), ``items`` /
``prefixItems`` (or a list ``items`` with ``additionalItems``), ``minItems`` / ``maxItems``, ``uniqueItems`` (of
literal items), ``minLength`` /
``maxLength``, ``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum`` / ``multipleOf``
(:mod:`dartspec.json_numbers`; such a number is written without an exponent), ``pattern``
(:mod:`dartspec.json_pattern`: ECMA-262 regular expressions without backreferences or lookarounds), ``enum``,
``const``, ``anyOf`` / ``oneOf`` (as alternatives: ``oneOf``'s exclusivity is not checked), a one-schema ``allOf``,
and ``$ref`` to ``#``, ``#/$defs/...`` or ``#/definitions/...`` (recursion included). A string's ``format`` is
followed where it is one of :data:`FORMATS` (``date``, ``time``, ``date-time``, ``duration``, ``uuid``, ``email``,
``ipv4``, ``hostname``: an answer a strict validator takes) and is otherwise, like the other annotations (``title``,
``description``, ``default``, ...), ignored, as JSON Schema lets a validator do. Any other keyword
(``dependentRequired``, ``if``, ...) is refused with its place in the schema: an answer that ignored it
could break it.

As OpenAI's structured outputs and most constrained decoders do, an object's properties come in the schema's order,
and an object with ``properties`` takes no other keys unless ``additionalProperties`` says so (an object schema without
``properties`` takes any keys). A schema that admits no finite document (``false``, a required property that cannot be
written, a ``$ref`` to itself) is refused; an optional property, other key or item that none can fill is never
started.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from dartspec.errors import DartspecError
from dartspec.json_grammar import Alt, Arr, Grammar, Lit, Node, Num, Obj, Str, Text, any_nodes, leaves
from dartspec.json_numbers import NumberBounds
from dartspec.json_pattern import Pattern, PatternError

#: Keywords that describe and never constrain.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "format",
        "$schema",
        "$id",
        "$comment",
        "$defs",
        "definitions",
        "deprecated",
        "readOnly",
        "writeOnly",
        "discriminator",
    }
)
_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
#: Each type's own keywords.
TYPE_KEYWORDS = {
    "object": frozenset(
        {
            "properties",
            "required",
            "additionalProperties",
            "minProperties",
            "maxProperties",
            "propertyNames",
            "patternProperties",
        }
    ),
    "array": frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"}),
    "string": frozenset({"minLength", "maxLength", "pattern"}),
    "number": _BOUNDS,
    "integer": _BOUNDS,
    "boolean": frozenset(),
    "null": frozenset(),
}
_YEAR = r"(?:[1-9]\d{3}|0[1-9]\d{2}|00[1-9]\d|000[1-9])"  # 0001-9999, as Python's dates (and jsonschema's check)
_LEAP = r"(?:\d{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)"
    rf"|02-(?:0[1-9]|1\d|2[0-8]))|{_LEAP}-02-29)"
)
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,6})?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_HMS = r"T(?:\d+H(?:\d+M)?(?:\d+S)?|\d+M(?:\d+S)?|\d+S)"
#: The string formats an answer is made to follow, as patterns (the rest stay annotations): RFC 3339 dates and times
#: (real calendar days, leap years included; no leap seconds), ISO 8601 durations, UUIDs, e-mail addresses of the
#: common dotted form, IPv4 addresses without leading zeros, host names of RFC 1123 labels.
FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "duration": rf"^P(?:\d+W|(?:\d+Y(?:\d+M)?(?:\d+D)?|\d+M(?:\d+D)?|\d+D)(?:{_HMS})?|{_HMS})$",
    "uuid": r"^[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}$",
    "email": rf"^[A-Za-z0-9_%+-]+(?:\.[A-Za-z0-9_%+-]+)*@(?:{_LABEL}\.)+[A-Za-z]{{2,63}}$",
    "ipv4": rf"^(?:{_OCTET}\.){{3}}{_OCTET}$",
    "hostname": rf"^{_LABEL}(?:\.{_LABEL})*$",
}
#: Nodes a schema may compile to, and how deep it may nest (a request's schema must stay small).
MAX_NODES = 10_000
MAX_DEPTH = 64


class SchemaError(DartspecError):
    """A JSON Schema this module cannot follow (the message names the keyword and where it is)."""


def compile_schema(schema: object, or_text: bool = False) -> Grammar:
    """The grammar of the documents ``schema`` admits (a :class:`SchemaError` says what it cannot follow); with
    ``or_text``, free text instead is admitted too (text that does not start as JSON: ``{``, ``[`` or whitespace)."""
    compiler = _Compiler(schema)
    root = compiler.node(schema, "#")
    productive = _productive(tuple(compiler.nodes))
    if root not in productive:
        raise SchemaError("the JSON schema admits no finite document")
    compiler.nodes = [_writable(n, productive) for n in compiler.nodes]
    if or_text:
        root = compiler.add(Alt((root, compiler.add(Text()))))
    return Grammar(compiler.nodes, root)


def canonical(value: object) -> bytes:
    """The JSON text an enum or const value must be written as (compact, UTF-8)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class _Compiler:
    def __init__(self, root: object) -> None:
        self.root = root
        self.nodes: list[Node] = []
        self.refs: dict[str, int] = {}  # a reference -> its node
        self.any_value: int | None = None  # the node of any JSON value, once made
        self.depth = 0

    def add(self, node: Node) -> int:
        if len(self.nodes) >= MAX_NODES:
            raise SchemaError(f"the JSON schema is too large (over {MAX_NODES} nodes)")
        self.nodes.append(node)
        return len(self.nodes) - 1

    def node(self, schema: object, where: str) -> int:
        if self.depth >= MAX_DEPTH:
            raise SchemaError(f"{where}: the JSON schema nests deeper than {MAX_DEPTH} levels")
        self.depth += 1
        try:
            return self._node(schema, where)
        finally:
            self.depth -= 1

    def _node(self, schema: object, where: str) -> int:
        if schema is True:
            return self.any()
        if schema is False:
            return self.add(Alt(()))
        if not isinstance(schema, Mapping):
            raise SchemaError(f"{where}: a schema must be an object or a boolean, got {type(schema).__name__}")
        keys = set(schema) - ANNOTATIONS
        if "$ref" in keys:
            _only(schema, keys, {"$ref"}, where)
            return self.ref(schema["$ref"], where)
        for combinator in ("anyOf", "oneOf", "allOf"):
            if combinator in keys:
                _only(schema, keys, {combinator}, where)
                options = schema[combinator]
                if not isinstance(options, list) or not options:
                    raise SchemaError(f"{where}/{combinator} must be a non-empty list of schemas")
                if combinator == "allOf" and len(options) > 1:
                    raise SchemaError(f"{where}/allOf: only a single schema is supported")
                return self.one_of([self.node(s, f"{where}/{combinator}/{i}") for i, s in enumerate(options)])
        if "const" in keys or "enum" in keys:
            return self.literals(schema, keys, where)
        types = schema.get("type")
        if types is None:  # no type: the one its keywords imply (a followed format: a string), or any value
            types = [t for t, words in TYPE_KEYWORDS.items() if words & keys][:1] or None
            if types is None and isinstance(schema.get("format"), str) and schema["format"] in FORMATS:
                types = ["string"]
            if types is None:
                _only(schema, keys, set(), where)
                return self.any()
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types or any(t not in TYPE_KEYWORDS for t in types):
            raise SchemaError(f"{where}/type must be one of {', '.join(TYPE_KEYWORDS)} or a list of them")
        _only(schema, keys, {"type"}.union(*(TYPE_KEYWORDS[t] for t in types)), where)
        return self.one_of([self.typed(t, schema, where) for t in dict.fromkeys(types)])

    def any(self) -> int:
        if self.any_value is None:
            self.any_value = len(self.nodes)
            for node in any_nodes(len(self.nodes)):
                self.add(node)
        return self.any_value

    def one_of(self, ids: list[int]) -> int:
        """The node of one of ``ids`` (that node itself where there is one)."""
        return ids[0] if len(ids) == 1 else self.add(Alt(tuple(ids)))

    def ref(self, ref: object, where: str) -> int:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(f"{where}/$ref: only references inside the schema (#, #/$defs/...) are supported")
        if ref not in self.refs:
            alias = self.refs[ref] = self.add(Alt(()))  # set below: a reference may lead back to itself
            self.nodes[alias] = Alt((self.node(_resolve(self.root, ref, where), ref),))
        return self.refs[ref]

    def literals(self, schema: Mapping[str, Any], keys: set[str], where: str) -> int:
        _only(schema, keys, {"const", "enum", "type"}, where)
        if "const" in keys:
            values = [schema["const"]]
        elif not isinstance(schema["enum"], list) or not schema["enum"]:
            raise SchemaError(f"{where}/enum must be a non-empty list")
        else:
            values = schema["enum"]
        try:
            texts = list(dict.fromkeys(canonical(v) for v in values))
        except (TypeError, ValueError, RecursionError) as err:
            raise SchemaError(f"{where}: an enum or const value is not JSON ({err})") from None
        return self.one_of([self.add(Lit(t)) for t in texts])

    def typed(self, kind: str, schema: Mapping[str, Any], where: str) -> int:
        if kind == "object":
            return self.object(schema, where)
        if kind == "array":
            return self.array(schema, where)
        if kind == "string":
            return self.string(schema, where)
        if kind in ("number", "integer"):
            return self.add(Num(kind == "integer", _number_bounds(schema, kind == "integer", where)))
        if kind == "boolean":
            return self.add(Alt((self.add(Lit(b"true")), self.add(Lit(b"false")))))
        return self.add(Lit(b"null"))

    def string(self, schema: Mapping[str, Any], where: str) -> int:
        """A string within its length bounds, matching its ``pattern``, or else its ``format`` where it is one of
        :data:`FORMATS` (with both, the pattern alone: the format stays an annotation)."""
        low, high = _bounds(schema, "minLength", "maxLength", where)
        if "pattern" in schema:
            source, place = schema["pattern"], f"{where}/pattern"
        elif isinstance(schema.get("format"), str) and schema["format"] in FORMATS:
            source, place = FORMATS[schema["format"]], f"{where}/format"
            if schema["format"] == "hostname":
                high = 253 if high is None else min(high, 253)
        else:
            return self.add(Str(low, high))
        try:
            return self.add(Str(low, high, Pattern(source, low, high)))
        except PatternError as err:
            raise SchemaError(f"{place}: {err}") from None

    def array(self, schema: Mapping[str, Any], where: str) -> int:
        """An array: ``prefixItems`` (or, as before draft 2020-12, a list ``items`` with ``additionalItems``) for its
        first items, ``items`` for the rest (``false``: no more than the prefix)."""
        items, prefix, place = schema.get("items", True), schema.get("prefixItems", []), "prefixItems"
        if isinstance(items, list):
            if "prefixItems" in schema:
                raise SchemaError(f"{where}: a list 'items' and 'prefixItems' cannot both be given")
            items, prefix, place = schema.get("additionalItems", True), items, "items"
        if not isinstance(prefix, list):
            raise SchemaError(f"{where}/prefixItems must be a list of schemas")
        low, high = _bounds(schema, "minItems", "maxItems", where)
        firsts = tuple(self.node(s, f"{where}/{place}/{i}") for i, s in enumerate(prefix))
        if items is False:
            high = len(firsts) if high is None else min(high, len(firsts))
        rest = self.node(items, f"{where}/{'additionalItems' if place == 'items' else 'items'}")
        unique = schema.get("uniqueItems", False)
        if not isinstance(unique, bool):
            raise SchemaError(f"{where}/uniqueItems must be true or false, got {unique!r}")
        values = self.unique_values([*firsts, rest], where) if unique else None
        return self.add(Arr(rest, low, high, firsts, values))

    def unique_values(self, items: list[int], where: str) -> tuple[tuple[int, int], ...]:
        """``uniqueItems`` where every item is a literal (an enum's, a const's, a boolean, null): each literal node with
        the id of its JSON value (``1`` and ``1.0`` are one value, ``true`` and ``1`` two)."""
        literals = leaves(self.nodes, items)
        if not all(isinstance(self.nodes[leaf], Lit) for leaf in literals):
            raise SchemaError(
                f"{where}/uniqueItems: only items of enum, const, boolean or null values are supported (where an "
                "answer can be checked item by item)"
            )
        ids: dict[object, int] = {}
        return tuple(
            (leaf, ids.setdefault(_value_key(json.loads(self.nodes[leaf].text)), len(ids)))  # type: ignore[union-attr]
            for leaf in sorted(literals)
        )

    def object(self, schema: Mapping[str, Any], where: str) -> int:
        props = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(props, Mapping) or not all(isinstance(k, str) for k in props):
            raise SchemaError(f"{where}/properties must be an object of schemas")
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise SchemaError(f"{where}/required must be a list of property names")
        missing = [k for k in required if k not in props]
        if missing:
            raise SchemaError(f"{where}/required names {missing[0]!r}, which is not among its properties")
        patterns = schema.get("patternProperties", {})
        if not isinstance(patterns, Mapping):
            raise SchemaError(f"{where}/patternProperties must be an object of schemas")
        # As with named properties, the keys of patternProperties are the only other ones unless said otherwise.
        extra_schema = schema.get("additionalProperties", "properties" not in schema and not patterns)
        extra = None if extra_schema is False else self.node(extra_schema, f"{where}/additionalProperties")
        low, high = _bounds(schema, "minProperties", "maxProperties", where)
        names = _KeyNames(self, schema.get("propertyNames", True), f"{where}/propertyNames")
        keyed = {p: (names.pattern(p, f"{where}/patternProperties/{_escape(p)}"), s) for p, s in patterns.items()}
        for key in props:  # a named key is held to propertyNames, and may not fall under a pattern as well
            if key in required and not names.admits(key):
                raise SchemaError(f"{where}/required names {key!r}, which propertyNames does not admit")
            if any(pattern.matches(key) for pattern, _ in keyed.values()):
                raise SchemaError(f"{where}/properties/{_escape(key)}: its name matches a patternProperties pattern")
        named = tuple(
            (canonical(k), self.node(s, f"{where}/properties/{_escape(k)}"), k in required)
            for k, s in props.items()
            if names.admits(k)
        )
        banned = tuple(canonical(k)[1:-1] for k in props if not names.admits(k))
        values = {p: self.node(s, f"{where}/patternProperties/{_escape(p)}") for p, (_, s) in keyed.items()}
        literal_keys, key = None, None
        if names.literals is not None:  # the other keys are a list: each with the value its pattern (or none) says
            literal_keys = []
            for name in names.literals:
                if name in props:
                    continue
                under = [p for p, (pattern, _) in keyed.items() if pattern.matches(name)]
                if len(under) > 1:
                    raise SchemaError(f"{where}/patternProperties: the name {name!r} matches several patterns")
                value = values[under[0]] if under else extra
                if value is not None:
                    literal_keys.append((canonical(name), value))
            literal_keys, extra = tuple(literal_keys), None
        elif keyed:  # other keys are those of one pattern (and propertyNames' lengths)
            if len(keyed) > 1 or extra is not None:
                raise SchemaError(
                    f"{where}/patternProperties: one pattern, without additionalProperties, is supported (or a "
                    "propertyNames enum listing the names)"
                )
            ((source, (pattern, _)),) = keyed.items()
            key, extra = self.add(Str(names.low, names.high, pattern)), values[source]
        elif names.constrained and extra is not None:
            if props:
                raise SchemaError(f"{where}/propertyNames: other keys beside properties must be free strings here")
            key = self.add(Str(names.low, names.high, names.own))
        if (key is not None or names.constrained) and low > 0 and literal_keys is None:
            raise SchemaError(f"{where}: minProperties with keys a pattern or lengths check is not supported")
        if high is not None and high < len(set(required)):
            raise SchemaError(f"{where}: maxProperties {high} is below the {len(set(required))} required properties")
        room = len(named) + (len(literal_keys) if literal_keys is not None else math.inf if extra is not None else 0)
        if low > room:
            raise SchemaError(f"{where}: minProperties {low} is above the {room} properties it may have")
        return self.add(Obj(named, extra, low, high, banned, literal_keys, key))


class _KeyNames:
    """What ``propertyNames`` admits: a list of names (an enum or const of strings), or strings within lengths and
    perhaps a pattern, or any string."""

    def __init__(self, compiler: _Compiler, schema: object, where: str) -> None:
        self.literals: list[str] | None = None
        self.low, self.high, self.own = 0, None, None
        if schema is True:
            self.constrained = False
            return
        self.constrained = True
        node = compiler.node(schema, where)
        found = [compiler.nodes[leaf] for leaf in leaves(compiler.nodes, [node])]
        if found and all(isinstance(n, Lit) and n.text.startswith(b'"') for n in found):
            self.literals = list(dict.fromkeys(json.loads(n.text) for n in found))  # type: ignore[union-attr]
        elif len(found) == 1 and isinstance(found[0], Str):
            self.low, self.high, self.own = found[0].min_length, found[0].max_length, found[0].pattern
            self.constrained = bool(self.low) or self.high is not None or self.own is not None  # not just "a string"
        else:
            raise SchemaError(f"{where}: only a string schema (lengths, a pattern, a format) or an enum of strings")

    def admits(self, name: str) -> bool:
        if self.literals is not None:
            return name in self.literals
        length = len(name.encode("utf-16-le")) // 2  # as JSON Schema counts: UTF-16 code units
        if length < self.low or (self.high is not None and length > self.high):
            return False
        return self.own is None or self.own.matches(name)

    def pattern(self, source: str, where: str) -> Pattern:
        """The pattern of a patternProperties key (with propertyNames' lengths; not beside a pattern of its own)."""
        if self.own is not None:
            raise SchemaError(f"{where}: a pattern beside one in propertyNames is not supported")
        try:
            return Pattern(source, self.low, self.high)
        except PatternError as err:
            raise SchemaError(f"{where}: {err}") from None


def _only(schema: Mapping[str, Any], keys: set[str], allowed: set[str], where: str) -> None:
    """Refuse a keyword that the schema's kind does not take (or this module does not support)."""
    for key in sorted(keys - allowed):
        raise SchemaError(f"{where}: the JSON schema keyword {key!r} is not supported here")


def _bounds(schema: Mapping[str, Any], low_key: str, high_key: str, where: str) -> tuple[int, int | None]:
    low, high = schema.get(low_key, 0), schema.get(high_key)
    for key, value in ((low_key, low), (high_key, high)):
        if value is not None and not (type(value) is int and value >= 0):
            raise SchemaError(f"{where}/{key} must be a non-negative integer, got {value!r}")
    if high is not None and low > high:
        raise SchemaError(f"{where}: {low_key} {low} is above {high_key} {high}")
    return low, high


def _number_bounds(schema: Mapping[str, Any], integer: bool, where: str) -> NumberBounds | None:
    """``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum`` (numbers, as since draft 6), the tighter
    of each side where both are given, and ``multipleOf``; None where none is."""
    given = {}
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        if key in schema:
            value = schema[key]
            if type(value) not in (int, float) or not math.isfinite(value):
                raise SchemaError(f"{where}/{key} must be a number, got {value!r}")
            given[key] = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    if not given:
        return None
    if given.get("multipleOf", 1) <= 0:
        raise SchemaError(f"{where}/multipleOf must be above 0, got {schema['multipleOf']!r}")
    low, low_open = given.get("minimum"), False
    if "exclusiveMinimum" in given and (low is None or given["exclusiveMinimum"] >= low):
        low, low_open = given["exclusiveMinimum"], True
    high, high_open = given.get("maximum"), False
    if "exclusiveMaximum" in given and (high is None or given["exclusiveMaximum"] <= high):
        high, high_open = given["exclusiveMaximum"], True
    bounds = NumberBounds(low, high, low_open, high_open, integer, given.get("multipleOf"))
    if bounds.empty():
        raise SchemaError(f"{where}: no {'integer' if integer else 'number'} lies within its bounds")
    return bounds


def _value_key(value: object) -> object:
    """A JSON value as JSON Schema compares them: numbers by value (``1`` == ``1.0``), booleans apart from numbers,
    objects whatever their key order."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    if isinstance(value, int | float):
        return ("number", Decimal(repr(value)).normalize())
    if isinstance(value, list):
        return ("array", tuple(_value_key(v) for v in value))
    return ("object", tuple(sorted((k, _value_key(v)) for k, v in value.items())))  # type: ignore[attr-defined]


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _resolve(root: object, ref: str, where: str) -> object:
    """The schema a JSON pointer reference names."""
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or part not in node:
            raise SchemaError(f"{where}/$ref: {ref!r} names nothing in the schema")
        node = node[part]
    return node


def _writable(node: Node, productive: set[int]) -> Node:
    """``node`` without the optional properties, other keys or items no finite document can fill (a ``false`` schema,
    a ``$ref`` to itself): the grammar never starts what it could not finish."""
    if isinstance(node, Obj):
        props = tuple(p for p in node.props if p[2] or p[1] in productive)
        extra = node.extra if node.extra in productive and (node.key is None or node.key in productive) else None
        listed = node.literal_keys
        if listed is not None:
            listed = tuple(k for k in listed if k[1] in productive)
        if (props, extra, listed) == (node.props, node.extra, node.literal_keys):
            return node
        banned = node.banned + tuple(p[0][1:-1] for p in node.props if p not in props)  # no other key may spell one
        return dataclasses.replace(node, props=props, extra=extra, banned=banned, literal_keys=listed)
    if isinstance(node, Alt):
        options = tuple(o for o in node.options if o in productive)
        return node if options == node.options else Alt(options)
    if isinstance(node, Arr):
        # items up to the first one that cannot be written (min_items never reaches it in a productive array)
        last = next((i for i in range(len(node.prefix)) if node.prefix[i] not in productive), None)
        if last is None and node.items not in productive:
            last = len(node.prefix)
        if last is not None and (node.max_items is None or node.max_items > last):
            return dataclasses.replace(node, max_items=last)
    return node


def _productive(nodes: tuple[Node, ...]) -> set[int]:
    """The nodes that admit some finite document (a fixpoint: a literal, string or number does; a container when
    what it must hold does; alternatives when one does)."""
    done: set[int] = set()
    changed = True
    while changed:
        changed = False
        for i, n in enumerate(nodes):
            if i in done:
                continue
            if isinstance(n, Alt):
                ok = any(o in done for o in n.options)
            elif isinstance(n, Obj):
                ok = all(v in done for _, v, required in n.props if required)
                if n.literal_keys is not None:
                    more: float = sum(v in done for _, v in n.literal_keys)
                else:
                    more = math.inf if n.extra in done and (n.key is None or n.key in done) else 0
                ok = ok and sum(v in done for _, v, _ in n.props) + more >= n.min_props
            elif isinstance(n, Arr):
                ok = all(n.item(i) in done for i in range(min(n.min_items, len(n.prefix) + 1)))
                ok = ok and (n.unique is None or n.min_items <= n.values)
            elif isinstance(n, Str) and n.pattern is not None:
                ok = n.pattern.live(n.pattern.start, 0)
            else:
                ok = True
            if ok:
                done.add(i)
                changed = True
    return done
