"""OpenAI function calling on any model, by constrained decoding.

A call is a JSON document that names one of the functions and gives arguments its parameter schema admits
(:mod:`dartspec.json_schema`): ``{"name": ..., "arguments": {...}}``, or with ``parallel_tool_calls`` (the default)
also a list of them (a model writes the one call it means as one object, and rarely a list it then never ends). It is
decoded under the constraint as any structured answer is (lossless under speculation), so the model cannot name a
function that does not exist or give arguments its schema refuses.

``tool_choice`` ``"required"`` (or one function named): the answer is a call. ``"auto"`` (the default with tools): the
answer is a call or text, told apart by its first byte (a call starts with ``{`` or ``[``, text with anything else), so
the model decides, and the grammar keeps a call well-formed once it starts one. ``"none"``: text.

The model is told of the functions in the system message (every model, whatever its chat template knows of tools: the
call syntax is this module's, not the model family's), and an earlier assistant turn's calls come back to it as JSON in
the shape it answered with.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dartspec.errors import DartspecError, FieldError
from dartspec.json_grammar import Grammar
from dartspec.json_schema import SchemaError, compile_schema

if TYPE_CHECKING:
    from dartspec.serve.schema import ChatRequest, ToolCall

#: The arguments of a function declared without parameters: none.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(FieldError):
    """A request's tools that cannot be served (``param`` names the field)."""


def call_mode(req: ChatRequest) -> str | None:
    """What the answer may be: "required" (a call), "auto" (a call or text) or None (text: no tools, or "none")."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    return "auto" if choice in (None, "auto") else "required"


def call_grammar(req: ChatRequest) -> Grammar:
    """The grammar of an answer that may be a call: the call schema's, with "auto" also free text."""
    return compile_schema(call_schema(req), or_text=call_mode(req) == "auto")


def call_schema(req: ChatRequest) -> dict[str, Any]:
    """The JSON Schema of the answer: a call of one of the tools (of the named one), or a list of such calls."""
    tools = req.tools or []
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ToolError(f"two tools are named {name!r}", f"tools.{i}.function.name")
    choice = req.tool_choice
    wanted = [choice.function.name] if choice is not None and not isinstance(choice, str) else names
    if wanted[0] not in names:
        raise ToolError(f"tool_choice names {wanted[0]!r}, which is not among the tools", "tool_choice")
    calls = []
    for i, tool in enumerate(tools):
        if tool.function.name not in wanted:
            continue
        parameters = tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS
        try:
            compile_schema(parameters)
        except SchemaError as err:
            raise ToolError(f"tools.{i}.function.parameters: {err}", f"tools.{i}.function.parameters") from None
        call = {
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        calls.append(call)
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]} if req.parallel_tool_calls else one


def with_tools(messages: list[dict[str, str]], req: ChatRequest) -> list[dict[str, str]]:
    """The conversation with the functions described in its system message (one is added where there is none)."""
    if not req.tools:
        return messages
    listed = [
        {"name": t.function.name, "description": t.function.description or "", "parameters": t.function.parameters}
        for t in req.tools or []
    ]
    shape = '{"name": <function name>, "arguments": {<its arguments>}}'
    several = " (several calls at once: a JSON list of them)" if req.parallel_tool_calls else ""
    how = {
        "required": f"Answer with a call, as JSON: {shape}{several}.",
        "auto": f"When one of them helps to answer, reply with only the call, as JSON: {shape}{several}. "
        "Otherwise answer in text.",
        None: "Do not call them now: answer in text.",
    }[call_mode(req)]
    note = (
        "You can call these functions (each one's arguments as a JSON Schema):\n"
        f"{json.dumps(listed, ensure_ascii=False)}\n{how}"
    )
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + note}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def calls_text(calls: Sequence[ToolCall]) -> str:
    """An earlier assistant turn's calls as JSON in an answer's shape (one call an object, several a list): what it
    answered with, up to whitespace."""
    out = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            raise DartspecError(f"tool call {call.id!r}: its arguments are not JSON") from None
        out.append({"name": call.function.name, "arguments": arguments})
    return json.dumps(out if len(out) > 1 else out[0], ensure_ascii=False)


def tool_calls(text: str) -> list[dict[str, Any]] | None:
    """OpenAI's ``tool_calls`` of a whole answer (a call or a list of calls), each with an id of its own; None where
    the answer is text, or a call not whole (a stop string cut it)."""
    if not text.startswith(("{", "[")):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls = value if isinstance(value, list) else [value]
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
        }
        for c in calls
    ]
