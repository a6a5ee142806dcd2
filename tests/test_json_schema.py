"""JSON Schema grammars against an independent validator (``jsonschema``): on random schemas, every document drawn from
the schema (keys in the schema's order) is accepted with every prefix alive, and any text the grammar finds whole,
near misses of those documents included, parses and validates (under the stated strictness: named keys in order, no
other keys unless ``additionalProperties`` allows them). Unsupported keywords and unsatisfiable schemas are refused
with where they are."""

from __future__ import annotations

import copy
import json
import math
from fractions import Fraction
from typing import Any

import jsonschema
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dartspec.json_grammar import Grammar
from dartspec.json_schema import SchemaError, compile_schema

# Keys are written as the schema spells them (UTF-8, escaping only what JSON must): the grammar takes that form only.
NAMES = st.sampled_from(["a", "b", "ab", "id", "name", "x y", 'q"', "é"])
SCALARS = st.none() | st.booleans() | st.integers(-50, 50) | st.sampled_from(["u", "v w", "é", 'say "hi"', 1.5])


@st.composite
def _bounded(draw: st.DrawFn) -> dict[str, Any]:
    """An integer or number with some of its four bounds (never an empty range), ends at halves too, and perhaps a
    ``multipleOf``."""
    low = draw(st.integers(-30, 30)) + draw(st.sampled_from([0, 0.5]))
    high = low + draw(st.integers(2, 40)) + draw(st.sampled_from([0, 0.5]))
    schema: dict[str, Any] = {"type": draw(st.sampled_from(["integer", "number"]))}
    for side, value in (("minimum", low), ("maximum", high)):
        how = draw(st.sampled_from(["", "plain", "exclusive"]))
        if how:
            schema[side if how == "plain" else "exclusive" + side.capitalize()] = value
    # binary fractions only: jsonschema divides floats
    multiple = draw(st.sampled_from([None, None, 2, 3, 7, 0.5, 0.25, 1.5]))
    step = multiple if schema["type"] == "number" or multiple is None else Fraction(multiple).numerator
    if multiple is not None and high - low > 2 * step:  # some multiple inside, whichever ends are open
        schema["multipleOf"] = multiple
    return schema


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    lengths = st.fixed_dictionaries({}, optional={"minLength": st.integers(0, 3), "maxLength": st.integers(3, 6)})
    return st.one_of(
        lengths.map(lambda d: {"type": "string", **d}),
        st.sampled_from([{"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}, {}]),
        st.sampled_from([{"type": ["string", "null"]}, {"type": ["integer", "boolean"]}]),
        st.lists(SCALARS, min_size=1, max_size=4).map(lambda v: {"enum": v}),
        SCALARS.map(lambda v: {"const": v}),
        _bounded(),
    )


def _containers(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def obj(draw: st.DrawFn) -> dict[str, Any]:
        props = draw(st.dictionaries(NAMES, inner, max_size=4))
        schema: dict[str, Any] = {"type": "object", "properties": props}
        schema["required"] = [k for k in props if draw(st.booleans())]
        extra = draw(st.sampled_from(["absent", "false", "true", "schema"]))
        if extra != "absent":
            schema["additionalProperties"] = {"false": False, "true": True, "schema": {"type": "integer"}}[extra]
        keys = draw(st.sampled_from(["free", "free", "listed", "pattern"]))
        others = 2 if extra in ("true", "schema") else 0
        if keys == "listed":  # propertyNames lists the names: the named ones, and others the pattern (if any) types
            more = draw(st.lists(st.sampled_from(["zz", "abc", "i"]), unique=True, min_size=0 if props else 1))
            schema["propertyNames"] = {"enum": [*props, *more]}
            if draw(st.booleans()):
                schema["patternProperties"] = {"^z": {"type": "integer"}}
            others = sum(extra in ("true", "schema") or (k == "zz" and "patternProperties" in schema) for k in more)
        elif keys == "pattern":  # other keys of a pattern no named key matches, perhaps of bounded length
            schema.pop("additionalProperties", None)
            schema["patternProperties"] = {"^z[a-z]*$": draw(inner)}
            if draw(st.booleans()):
                schema["propertyNames"] = {"maxLength": 5}
        if draw(st.booleans()):  # bounds on the number of keys, some satisfiable count inside
            count = draw(st.integers(len(schema["required"]), len(props) + others))
            if keys != "pattern":  # (minProperties is not supported with such keys)
                schema["minProperties"] = draw(st.integers(0, count))
            if draw(st.booleans()):
                schema["maxProperties"] = draw(st.integers(count, count + 2))
        return schema

    @st.composite
    def arr(draw: st.DrawFn) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "array", "items": draw(inner | st.just(False))}
        prefix = draw(st.lists(inner, max_size=3))
        if prefix:  # (the metaschema wants a non-empty list)
            schema["prefixItems"] = prefix
        low = draw(st.integers(0, 2 if schema["items"] is not False else len(prefix)))
        schema["minItems"] = low
        if not prefix and _literals(schema["items"]) is not None and low <= 1 and draw(st.booleans()):
            schema["uniqueItems"] = True
        if draw(st.booleans()):
            schema["maxItems"] = low + draw(st.integers(0, 2))
        return schema

    return obj() | arr() | st.lists(inner, min_size=1, max_size=3).map(lambda s: {"anyOf": s})


SCHEMAS = st.recursive(_leaf(), _containers, max_leaves=8)


def _literals(schema: Any) -> list[Any] | None:
    """The values of a schema that admits only literals (an enum, a const, booleans, null), distinct; else None."""
    if not isinstance(schema, dict):
        return None
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
    elif schema.get("type") in ("boolean", "null"):
        values = [True, False] if schema["type"] == "boolean" else [None]
    else:
        return None
    return list({json.dumps(v): v for v in values}.values())


@st.composite
def instance(draw: st.DrawFn, schema: Any, root: Any = None) -> Any:
    """A document ``schema`` admits, keys in the schema's order (written from the schema, not the grammar)."""
    root = schema if root is None else root
    if schema is True or schema == {}:
        return draw(SCALARS | st.lists(SCALARS, max_size=2) | st.dictionaries(NAMES, SCALARS, max_size=2))
    if "$ref" in schema:
        return draw(instance(root["$defs"][schema["$ref"].split("/")[-1]], root))
    if "anyOf" in schema:
        return draw(instance(draw(st.sampled_from(schema["anyOf"])), root))
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return draw(st.sampled_from(schema["enum"]))
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    kind = draw(st.sampled_from(types))
    if kind == "object":
        props, required = schema.get("properties", {}), schema.get("required", [])
        patterns = schema.get("patternProperties", {})
        extra = schema.get("additionalProperties", "properties" not in schema and not patterns)
        listed = schema.get("propertyNames", {}).get("enum")
        if listed is not None:  # the listed names; those of the pattern take its schema
            others = {k: patterns.get("^z", extra) if k.startswith("z") else extra for k in listed if k not in props}
        elif patterns:
            others = {k: patterns["^z[a-z]*$"] for k in ("z", "zz", "zab")}
        else:  # prefixes of named keys, and keys that start as they do
            others = {k: extra for k in ("zz", "abc", "nam", "i", "a", "id") if k not in props}
        others = {k: v for k, v in others.items() if v is not False}
        low, high = schema.get("minProperties", 0), schema.get("maxProperties", len(props) + len(others))
        count = draw(st.integers(max(low, len(required)), min(high, len(props) + len(others))))
        optional = [k for k in props if k not in required]
        named = set(required) | set(draw(st.permutations(optional))[: max(0, count - len(required))])
        out = {key: draw(instance(sub, root)) for key, sub in props.items() if key in named}
        for key in draw(st.permutations(sorted(others)))[: count - len(out)]:
            out[key] = draw(instance(True if others[key] is True else others[key], root))
        return out
    if kind == "array":
        prefix = schema.get("prefixItems", [])
        high = schema.get("maxItems", schema.get("minItems", 0) + 2)
        high = min(high, len(prefix)) if schema["items"] is False else high
        n = draw(st.integers(schema.get("minItems", 0), high))
        if schema.get("uniqueItems"):  # distinct literals
            return draw(st.permutations(_literals(schema["items"])))[:n]
        return [draw(instance(prefix[i] if i < len(prefix) else schema["items"], root)) for i in range(n)]
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength", 8)
        return draw(
            st.text(st.characters(max_codepoint=0xFFFF, exclude_categories=("Cs",)), min_size=low, max_size=high)
        )
    if kind in ("integer", "number") and set(schema) & {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}:
        scale = 1 if kind == "integer" else 1000  # numbers in thousandths: written without an exponent
        low = schema.get("minimum", schema.get("exclusiveMinimum", -100))
        high = schema.get("maximum", schema.get("exclusiveMaximum", 100))
        value = draw(st.integers(math.ceil(low * scale), math.floor(high * scale))) / scale
        step = schema.get("multipleOf")
        if step is not None:  # the nearest multiple inside (an integer one for an integer)
            step = step if kind == "number" else math.lcm(int(step * 4), 4) / 4
            value = math.ceil(value / step) * step
            assume(value <= high)
        value = int(value) if kind == "integer" else value
        assume(value != schema.get("exclusiveMinimum") and value != schema.get("exclusiveMaximum"))
        return value
    if kind in ("integer", "number") and "multipleOf" in schema:
        step = schema["multipleOf"] if kind == "number" else math.lcm(int(schema["multipleOf"] * 4), 4) // 4
        return draw(st.integers(-1000, 1000)) * step
    if kind == "integer":
        return draw(st.integers(-(10**6), 10**6))
    if kind == "number":
        return draw(st.integers(-100, 100) | st.floats(allow_nan=False, allow_infinity=False))
    return draw(st.booleans()) if kind == "boolean" else None


def strict(schema: Any) -> Any:
    """The schema as the grammar reads it, for ``jsonschema``: an object with properties takes no other keys unless it
    says so."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if ("properties" in schema or "patternProperties" in schema) and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def whole(grammar: Grammar, text: str) -> bool:
    state = grammar.advance(grammar.start(), text.encode())
    return state is not None and grammar.complete(state)


def assert_sound(grammar: Grammar, schema: Any, text: str) -> None:
    """A text the grammar finds whole parses, validates, and names its keys in the schema's order."""
    if not whole(grammar, text):
        return
    value = json.loads(text)
    jsonschema.validate(value, strict(copy.deepcopy(schema)))


def _dump(value: Any, indent: int | None, ascii_only: bool) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ascii_only)


@settings(max_examples=250, deadline=None)
@given(schema=SCHEMAS, data=st.data(), indent=st.sampled_from([None, 2]), ascii_only=st.booleans())
def test_documents_of_the_schema_are_accepted_and_near_misses_only_if_valid(
    schema: dict[str, Any], data: st.DataObject, indent: int | None, ascii_only: bool
) -> None:
    grammar = compile_schema(schema)
    value = data.draw(instance(schema))
    jsonschema.validate(value, strict(copy.deepcopy(schema)))  # the generator writes valid documents
    enums = "enum" in json.dumps(schema) or "const" in json.dumps(schema)
    # enum values are written compact, keys unescaped
    text = _dump(
        value, None if enums else indent, ascii_only and not enums and "é" not in json.dumps(schema, ensure_ascii=False)
    )
    state = grammar.start()
    for i, byte in enumerate(text.encode()):
        state = grammar.advance(state, bytes([byte]))
        assert state is not None, (text, i)
    assert grammar.complete(state), text
    for _ in range(6):
        at = data.draw(st.integers(0, len(text)))
        char = data.draw(st.sampled_from(list('{}[]",:.-0 1eantrulfx\\')))
        edit = data.draw(st.sampled_from(["insert", "delete", "replace"]))
        assert_sound(grammar, schema, text[:at] + (char if edit != "delete" else "") + text[at + (edit != "insert") :])


def test_properties_come_in_order_required_ones_always_others_only_when_allowed() -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array"}},
        "required": ["name", "age"],
    }
    g = compile_schema(schema)
    assert whole(g, '{"name": "ann", "age": 3}') and whole(g, '{"name":"ann","age":3,"tags":[1,"x"]}')
    assert not whole(g, '{"age": 3, "name": "ann"}')  # out of order
    assert not whole(g, '{"name": "ann"}') and not whole(g, '{"name":"ann","tags":[],"age":3}')
    assert not whole(g, '{"name":"ann","age":3,"zz":1}')  # no other keys
    assert not whole(g, '{"name":"ann","age":3.5}') and not whole(g, '{"name":"ann","age":3,}')
    g = compile_schema({**schema, "additionalProperties": {"type": "boolean"}})
    assert whole(g, '{"name":"ann","age":3,"zz":true,"yy":false}') and not whole(g, '{"name":"ann","age":3,"zz":1}')
    assert whole(g, '{"name":"ann","age":3,"nam":true,"names":false}')  # keys that start as named ones do
    assert not whole(g, '{"name":"ann","age":3,"tags":true}')  # a named key again, as another
    assert not whole(g, '{"name":"ann","age":3,"\\u0074ags":true}')  # ... even escaped
    assert whole(compile_schema({"type": "object"}), '{"any": [1, {"x": null}]}')  # no properties: any keys


def test_strings_numbers_literals_and_arrays_follow_their_bounds() -> None:
    g = compile_schema({"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3}, "maxItems": 2})
    assert whole(g, '["a", "\\u00e9\\n", "é"]') is False  # three items
    assert whole(g, '["abc", "é\\nx"]') and not whole(g, '["abcd"]') and not whole(g, '[""]')
    assert whole(g, "[]") and not whole(compile_schema({"type": "array", "minItems": 1}), "[]")
    g = compile_schema({"type": "integer"})
    assert whole(g, "-12") and not whole(g, "1.5") and not whole(g, "1e3") and not whole(g, "01")
    g = compile_schema({"enum": ["red", 1, None, [1, 2]]})
    assert all(whole(g, t) for t in ['"red"', "1", "null", "[1,2]"]) and not whole(g, "[1, 2]")
    assert not whole(g, '"re"') and not whole(g, "10") and whole(compile_schema({"enum": [1, 10]}), "10")
    g = compile_schema({"type": ["boolean", "null"]})
    assert whole(g, "true") and whole(g, "null") and not whole(g, '"true"')
    assert not whole(compile_schema({"type": "string"}), ' "a"')  # no whitespace before the document
    tuple_ = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False, "minItems": 1}
    g = compile_schema(tuple_)
    assert whole(g, '[1, "a"]') and whole(g, "[1]") and not whole(g, '[1, "a", 2]') and not whole(g, '["a"]')
    assert not whole(g, "[]") and not whole(g, "[1, 2]")
    g = compile_schema({"type": "array", "items": {"enum": ["a", "b", 1, 1.0, True]}, "uniqueItems": True})
    assert whole(g, '["a", "b", 1, true]') and not whole(g, '["a", "a"]') and not whole(g, "[1, 1.0]")
    assert whole(g, "[1, true]")  # true is not 1 (as JSON Schema compares)
    assert g.advance(g.start(), b'["a", "b", 1, true,') is None  # every value used: no dead end after a comma
    g = compile_schema(
        {"type": "array", "prefixItems": [{"const": "a"}], "items": {"enum": ["a", "b"]}, "uniqueItems": True}
    )
    assert whole(g, '["a", "b"]') and not whole(g, '["a", "a"]')
    g = compile_schema({"type": "array", "items": [{"type": "integer"}], "additionalItems": {"type": "null"}})
    assert whole(g, "[1, null, null]") and whole(g, "[]") and not whole(g, "[1, 2]")  # the form before 2020-12


def test_references_resolve_recursively() -> None:
    schema = {
        "$defs": {
            "Node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/Node"}}}
        },
        "$ref": "#/$defs/Node",
    }
    g = compile_schema(schema)
    assert whole(g, '{"v": 1, "next": {"v": 2, "next": {}}}') and not whole(g, '{"next": {"w": 1}}')
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]}
    assert whole(compile_schema(tree), '{"kids": [{"kids": []}, {"kids": [{"kids": []}]}]}')


def _nested(inner: Any, depth: int, kind: str = "items") -> Any:
    for _ in range(depth):
        inner = {"type": "array", "items": inner} if kind == "items" else [inner]
    return inner


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "#/uniqueItems: only items of enum"),
        ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 3}, "admits no finite"),
        (
            {"type": "object", "properties": {"n": {"dependentRequired": {"a": ["b"]}}}},
            "#/properties/n: the JSON schema keyword 'dependentRe",
        ),
        ({"propertyNames": {"type": "integer"}}, "#/propertyNames: only a string schema"),
        ({"propertyNames": {"enum": ["a", 1]}}, "#/propertyNames: only a string schema"),
        ({"patternProperties": {"^a": {}, "^b": {}}}, "one pattern, without additionalProperties"),
        ({"patternProperties": {"^a": {}}, "additionalProperties": {}}, "one pattern, without additionalProperties"),
        ({"properties": {"ab": {}}, "patternProperties": {"^a": {}}}, "#/properties/ab: its name matches a pattern"),
        ({"propertyNames": {"pattern": "^a"}, "patternProperties": {"b": {}}}, "beside one in propertyNames"),
        ({"patternProperties": {"^a": {}}, "minProperties": 1}, "minProperties with keys a pattern or lengths"),
        ({"properties": {"b": {}}, "required": ["b"], "propertyNames": {"enum": ["a"]}}, "propertyNames does not"),
        ({"properties": {"b": {}}, "additionalProperties": {}, "propertyNames": {"maxLength": 3}}, "beside properties"),
        ({"propertyNames": {"enum": ["a", "b"]}, "minProperties": 3}, "minProperties 3 is above the 2 properties"),
        ({"patternProperties": {"(": {}}}, "#/patternProperties/(: pattern '('"),
        ({"properties": {"a": {}, "b": {}}, "required": ["a", "b"], "maxProperties": 1}, "below the 2 required"),
        ({"properties": {"a": {}}, "additionalProperties": False, "minProperties": 2}, "above the 1 properties"),
        ({"type": "object", "minProperties": 3, "maxProperties": 2}, "minProperties 3 is above maxProperties 2"),
        ({"type": "object", "maxProperties": -1}, "maxProperties must be a non-negative integer"),
        ({"properties": {"a": False, "b": {}}, "additionalProperties": False, "minProperties": 2}, "no finite"),
        ({"type": "integer", "multipleOf": 0}, "multipleOf must be above 0"),
        ({"type": "integer", "minimum": 1, "maximum": 4, "multipleOf": 5}, "no integer lies within its bounds"),
        ({"type": "integer", "minimum": 2.5, "exclusiveMaximum": 3}, "no integer lies within its bounds"),
        ({"type": "number", "minimum": 1, "maximum": 1, "exclusiveMaximum": 1}, "no number lies within its bounds"),
        ({"type": "number", "maximum": "9"}, "maximum must be a number"),
        ({"type": "array", "items": [{}], "prefixItems": [{}]}, "a list 'items' and 'prefixItems' cannot both"),
        ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}, "admits no finite document"),
        ({"type": "object", "properties": {}, "required": ["a"]}, "'a', which is not among its properties"),
        ({"$ref": "#/$defs/missing"}, "names nothing"),
        ({"$ref": "https://example.com/s.json"}, "only references inside the schema"),
        ({"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}, "admits no finite document"),
        ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "admits no finite document"),
        ({"type": "array", "items": False, "minItems": 1}, "admits no finite document"),
        ({"type": "string", "minLength": 3, "maxLength": 2}, "minLength 3 is above maxLength 2"),
        ({"type": "date"}, "#/type must be one of"),
        ({"enum": []}, "non-empty list"),
        ({"allOf": [{}, {}]}, "only a single schema"),
        ([1], "a schema must be an object or a boolean"),
        (_nested({"type": "string"}, 70), "nests deeper than 64 levels"),
        (_nested({"const": _nested([], 5000, "x")}, 1), "not JSON"),
    ],
)
def test_unsupported_or_unsatisfiable_schemas_are_refused_with_where(schema: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=message.replace("$", r"\$").replace("(", r"\(")):
        compile_schema(schema)


def test_annotations_are_ignored_and_a_schema_without_type_takes_its_keywords_kind() -> None:
    g = compile_schema({"title": "T", "description": "d", "properties": {"a": {"format": "date", "type": "string"}}})
    assert whole(g, '{"a": "2026-11-27"}') and not whole(g, "[]")
    assert whole(compile_schema({"description": "anything"}), "[1, {}]") and whole(compile_schema(True), "null")


def test_or_text_admits_a_document_or_text_told_apart_by_the_first_byte() -> None:
    g = compile_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, or_text=True)
    assert whole(g, '{"a": 1}') and whole(g, "Hello {not json") and whole(g, "x")
    assert not whole(g, '{"a": "x"}') and not whole(g, '{"a": 1') and not whole(g, "[1]")  # JSON is held to it
    assert g.advance(g.start(), b" hi") is None and not whole(g, "")  # no leading whitespace, no empty answer
    assert not whole(compile_schema({"type": "object"}), "Hello")


@settings(max_examples=400, deadline=None)
@given(schema=_bounded(), text=st.from_regex(r"-?(0|[1-9][0-9]{0,2})(\.[0-9]{1,2})?", fullmatch=True))
def test_a_bounded_number_is_whole_exactly_when_jsonschema_takes_it(schema: dict[str, Any], text: str) -> None:
    """Against ``jsonschema`` on number texts near the bounds (an integer written with a point is refused, as a
    bounded number with an exponent is)."""
    valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
    try:
        g = compile_schema(schema)
    except SchemaError:  # no multiple inside the bounds
        assert not valid and "multipleOf" in schema
        return
    assert whole(g, text) == (valid and not (schema["type"] == "integer" and "." in text)), (schema, text)


@settings(max_examples=150, deadline=None)
@given(schema=_bounded(), text=st.from_regex(r"-?[0-9]{0,2}(\.[0-9]?)?", fullmatch=True))
def test_a_live_number_prefix_can_still_end_inside_the_bounds(schema: dict[str, Any], text: str) -> None:
    """No dead ends: where a prefix lives, some completion of at most three more characters is whole (the bounds
    are within +-71, two decimals enough), so a constrained answer can always go on."""
    try:
        g = compile_schema(schema)
    except SchemaError:  # no multiple inside the bounds
        return
    state = g.advance(g.start(), text.encode())
    if state is None:
        return
    digits = ["", *"0123456789"]
    tails = [""] + [a + b + c for a in "-0123456789." for b in [*digits, "."] for c in digits if b or not c]
    assert any(whole(g, text + tail) for tail in tails), (schema, text)


def test_multiples_hold_while_the_number_is_written() -> None:
    g = compile_schema({"type": "number", "exclusiveMinimum": 3, "maximum": 7, "multipleOf": 3})  # 6 alone
    assert whole(g, "6") and whole(g, "6.00") and not whole(g, "3") and not whole(g, "6.5")
    assert g.advance(g.start(), b"3") is None and g.advance(g.start(), b"6.1") is None
    g = compile_schema({"type": "number", "multipleOf": 0.25})
    assert whole(g, "-1.75") and not whole(g, "0.3") and g.advance(g.start(), b"1e") is None  # no exponent
    g = compile_schema({"type": "integer", "multipleOf": 2.5})  # integers that are multiples of 2.5: of 5
    assert whole(g, "15") and not whole(g, "12") and g.advance(g.start(), b"12") is not None  # 120 goes on
    with pytest.raises(SchemaError, match="no number lies within its bounds"):
        compile_schema({"type": "number", "exclusiveMinimum": 3, "exclusiveMaximum": 6, "multipleOf": 3})
    with pytest.raises(SchemaError, match="no integer lies within its bounds"):  # 12.5 is no integer
        compile_schema({"type": "integer", "minimum": 12, "maximum": 13, "multipleOf": 2.5})


def test_number_bounds_hold_while_the_number_is_written() -> None:
    g = compile_schema({"type": "integer", "minimum": 1, "maximum": 120})
    assert [whole(g, t) for t in ["1", "120", "99", "0", "121", "-1", "1200"]] == [True] * 3 + [False] * 4
    assert g.advance(g.start(), b"13") is not None and g.advance(g.start(), b"130") is None  # 13 lives, 130 cannot
    assert g.advance(g.start(), b"-") is None and g.advance(g.start(), b"0") is None
    g = compile_schema({"type": "number", "exclusiveMinimum": 0, "maximum": 1.5})
    assert [whole(g, t) for t in ["0.01", "1.5", "1.50", "1", "0", "0.0", "1.51", "-0.5"]] == [True] * 4 + [False] * 4
    assert g.advance(g.start(), b"1e") is None  # a bounded number takes no exponent
    g = compile_schema({"type": "object", "properties": {"n": {"type": "integer", "maximum": -10}}, "required": ["n"]})
    assert whole(g, '{"n": -10}') and whole(g, '{"n": -1000}') and not whole(g, '{"n": -9}')
    assert g.advance(g.start(), b'{"n": -9') is not None and g.advance(g.start(), b'{"n": -9}') is None  # -9x lives


def test_object_bounds_count_distinct_keys_and_leave_no_dead_end() -> None:
    """minProperties / maxProperties: a repeated other key is one property (as a JSON parser reads it), so it never
    counts towards the minimum; optional keys the required ones leave no room for are not offered; and from every
    live prefix some byte goes on (random walks over a small alphabet), each whole text valid for jsonschema."""
    import random

    g = compile_schema({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2})
    assert whole(g, '{"a": 1, "b": 2}') and whole(g, '{"a": 1, "b": 2, "a": 3}')  # two keys, then a repeat is harmless
    assert not whole(g, '{"a": 1, "a": 2}') and g.advance(g.start(), b'{"a": 1, "a"') is None
    assert g.advance(g.start(), b'{"a": 1, "ab"') is not None and not whole(g, '{"a": 1}')
    optional = {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}
    g = compile_schema({"properties": optional, "required": ["c"], "maxProperties": 2})
    assert whole(g, '{"a": 1, "c": 2}') and whole(g, '{"c": 2}') and g.advance(g.start(), b'{"a": 1, "b"') is None
    g = compile_schema({"properties": {"a": False, "b": {}}, "additionalProperties": {}, "minProperties": 1})
    assert g.advance(g.start(), b'{"a"') is None and whole(g, '{"b": 1}') and whole(g, '{"z": 1}')

    schemas = [
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2, "maxProperties": 3},
        {"properties": optional, "required": ["c"], "minProperties": 2, "maxProperties": 2},
        {"properties": optional, "additionalProperties": {"type": "integer"}, "minProperties": 4},
        {"properties": {"a": {"type": "object", "minProperties": 1, "maxProperties": 1}}, "required": ["a"]},
        {"type": "object", "maxProperties": 0},
        {"propertyNames": {"enum": ["a", "b", "c"]}, "additionalProperties": {"type": "integer"}, "minProperties": 2},
        # skipping the named one leaves two listed names: too few
        {
            "properties": {"c": {}},
            "propertyNames": {"enum": ["c", "a", "b"]},
            "additionalProperties": {},
            "minProperties": 3,
        },
        {"properties": {"a": {}}, "propertyNames": {"enum": ["a", "b"]}, "patternProperties": {"b": {"const": 1}}},
        {"patternProperties": {"^[ab]+$": {"type": "integer"}}, "propertyNames": {"maxLength": 2}, "maxProperties": 2},
        {"propertyNames": {"minLength": 2, "maxLength": 3}, "additionalProperties": {"const": 1}},
    ]
    alphabet = list(b'{}":, 1abc')
    rng = random.Random(0)
    for schema in schemas:
        grammar, checked = compile_schema(schema), strict(schema)
        for _ in range(200):
            state, text = grammar.start(), b""
            while not (grammar.complete(state) and (len(text) > 40 or rng.random() < 0.3)):
                nexts = [(b, grammar.advance(state, bytes([b]))) for b in alphabet]
                nexts = [(b, after) for b, after in nexts if after is not None]
                if not nexts and grammar.complete(state):
                    break  # a whole document nothing may follow
                assert nexts, (schema, text)  # a live prefix that nothing continues would be a dead end
                # towards an end once long: closing bytes, quotes and colons first
                closing = [n for n in nexts if n[0] in b'}":,'] if len(text) > 30 else []
                b, state = rng.choice(closing or nexts)
                text += bytes([b])
                assert len(text) < 400, text
            jsonschema.validate(json.loads(text), checked)


def test_keys_follow_property_names_and_pattern_properties() -> None:
    """propertyNames as a list of names (each at most once), or lengths; one patternProperties pattern for the other
    keys (escapes decoded), its schema for their values; a listed name under a pattern takes the pattern's schema."""
    g = compile_schema({"propertyNames": {"enum": ["red", "blue"]}, "additionalProperties": {"type": "integer"}})
    assert whole(g, '{"red": 1, "blue": 2}') and whole(g, '{"blue": 2}') and whole(g, "{}")
    assert not whole(g, '{"green": 1}') and not whole(g, '{"red": 1, "red": 2}') and not whole(g, '{"red": "x"}')
    assert g.advance(g.start(), b'{"red": 1, "blue": 2,') is None  # both names used: no dead end after a comma
    g = compile_schema({"propertyNames": {"enum": ["a", "zz"]}, "patternProperties": {"^z": {"const": True}}})
    assert whole(g, '{"zz": true}') and not whole(g, '{"zz": 1}') and not whole(g, '{"a": 1}')  # a: no schema
    g = compile_schema({"properties": {"id": {}}, "patternProperties": {"^x-": {"type": "string"}}})
    assert whole(g, '{"id": 1, "x-a": "b", "x-\u0063": "d"}') and not whole(g, '{"id": 1, "y": "b"}')
    assert not whole(g, '{"x-a": 1}') and not whole(g, '{"x-a": "b", "id": 1}')  # named ones first
    g = compile_schema({"propertyNames": {"maxLength": 2}, "additionalProperties": {}})
    assert whole(g, '{"ab": 1, "\u00e9": 2}') and not whole(g, '{"abc": 1}')
    g = compile_schema({"properties": {"long": {}, "a": {}}, "propertyNames": {"maxLength": 2}})
    assert whole(g, '{"a": 1}') and not whole(g, '{"long": 1}')  # a named key propertyNames refuses never comes


def test_a_pydantic_models_schema_compiles_and_admits_pydantics_own_json() -> None:
    """The schema pydantic writes for a model with the usual field kinds (UUID, dates, bounded and stepped numbers,
    enums, a set of enums, literals, tuples, optional and recursive models, dicts, patterned strings) compiles, and
    the JSON pydantic writes for instances of it is whole (its properties come in the schema's order)."""
    import datetime
    import enum
    import uuid
    from typing import Annotated, Literal

    pydantic = pytest.importorskip("pydantic")

    class Color(enum.StrEnum):
        red = "red"
        blue = "blue"

    class Address(pydantic.BaseModel):
        street: str
        zip: str = pydantic.Field(pattern=r"^\d{5}$")

    class Person(pydantic.BaseModel):
        id: uuid.UUID
        name: str = pydantic.Field(min_length=1, max_length=40)
        born: datetime.date
        seen: datetime.datetime
        age: int = pydantic.Field(ge=0, le=150)
        score: float = pydantic.Field(gt=0, lt=1)
        color: Color
        colors: set[Color] = pydantic.Field(default_factory=set)
        kind: Literal["a", "b"]
        tags: list[str] = pydantic.Field(max_length=3)
        pair: tuple[int, str]
        address: Address | None = None
        friends: list[Person] = pydantic.Field(default_factory=list)
        meta: dict[str, int] = pydantic.Field(default_factory=dict)
        ratings: dict[str, int] = pydantic.Field(default_factory=lambda: {"x": 1}, min_length=1, max_length=2)
        per_color: dict[Color, int] = pydantic.Field(default_factory=dict)
        codes: dict[Annotated[str, pydantic.StringConstraints(pattern=r"^[A-Z]{2}$")], float] = pydantic.Field(
            default_factory=dict
        )
        step: int = pydantic.Field(multiple_of=5, default=0)
        price: float = pydantic.Field(multiple_of=0.01, ge=0, default=0)

    grammar = compile_schema(Person.model_json_schema())
    seen = datetime.datetime(2024, 2, 29, 23, 59, 59, 123456, tzinfo=datetime.UTC)
    common = {"born": "2000-02-29", "seen": seen, "color": "red", "kind": "a", "tags": ["x"], "pair": (1, "y")}
    ann = Person(id=uuid.uuid4(), name="Ann", age=30, score=0.5, step=10, price=9.99, colors={"red", "blue"}, **common)
    bob = Person(
        id=uuid.uuid4(), name="Bob Li", age=0, score=0.001, address={"street": "Main", "zip": "12345"}, **common
    )
    bob.friends = [ann]
    bob.meta = {"k": -3}
    bob.ratings = {"x": 1, "y": 2}
    bob.per_color = {Color.blue: 3, Color.red: 0}
    bob.codes = {"FR": 1.5, "DE": -2.0}
    for person in (ann, bob):
        assert whole(grammar, person.model_dump_json()), person.model_dump_json()
        assert whole(grammar, person.model_dump_json(indent=2))
    assert not whole(grammar, ann.model_dump_json().replace('"step":10', '"step":12'))
    assert not whole(grammar, ann.model_dump_json().replace("2000-02-29", "2001-02-29"))
    assert not whole(grammar, ann.model_dump_json().replace('"ratings":{"x":1}', '"ratings":{}'))
    assert not whole(grammar, bob.model_dump_json().replace('"blue":3', '"green":3'))
    assert not whole(grammar, bob.model_dump_json().replace('"FR":', '"Fr":'))
    assert not whole(grammar, ann.model_dump_json().replace('"ratings":{"x":1}', '"ratings":{"x":1,"y":2,"z":3}'))
