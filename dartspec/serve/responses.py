"""OpenAI's Responses API (``POST /v1/responses``) for text answers, over the same generation as chat completions.

A request is turned into the chat completion of the same conversation (:meth:`ResponsesRequest.as_chat`:
``instructions`` as a system message, ``input`` a string or a list of messages, ``max_output_tokens``,
``temperature``, ``top_p``, ``text.format`` text / json_object / json_schema), so its answer is token for token the
chat completion's; what differs is the shape: a response object whose ``output`` is one assistant message, and, when
streamed, the API's typed events (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``,
or ``response.incomplete`` where ``max_output_tokens`` cut the answer). Function tools work as in chat completions
(:mod:`dartspec.serve.tools`: a call is decoded under its schema): a call comes back as ``function_call`` output
items, and ``function_call`` / ``function_call_output`` input items send calls and their results back. Tools other
than functions are refused.

Finished responses are kept in memory (:class:`ResponseStore`, the newest ``serve --max-stored-responses``, unless the
request says ``store: false``): ``previous_response_id`` continues the conversation of a stored response (its input
after the earlier ones', and its output; not its ``instructions``, as OpenAI's API does), and ``GET`` / ``DELETE
/v1/responses/{id}`` read and forget one. A server restart forgets them all.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from dartspec.engine import MAX_TOP_LOGPROBS, GenerationResult, StepEvent, TokenLogprob
from dartspec.errors import FieldError
from dartspec.serve.schema import (
    MAX_MESSAGES,
    MAX_SEED,
    MAX_TOOLS,
    ChatRequest,
    DartspecOptions,
    FunctionCall,
    Message,
    Text,
    ToolCall,
)
from dartspec.serve.tools import tool_calls

#: The ``include`` value that asks for the output text's log-probabilities (the only one this server reads).
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputText(BaseModel):
    """A text part of an input message (``output_text``: an earlier answer's, sent back)."""

    type: Literal["input_text", "output_text", "text"]
    text: Text


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    """A call an earlier answer made (sent back)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr  # JSON text


class FunctionCallOutput(BaseModel):
    """A call's result."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: StrictStr
    output: Text


_ITEM_TYPES = ("message", "function_call", "function_call_output")


def _items(value: Any) -> Any:
    """An input list's items checked for what this server reads (messages of text, calls and their results), so
    that a refusal names the item and what it is, rather than pydantic's first union member ("should be a valid
    string"); a message may leave out its type."""
    if not isinstance(value, list):
        return value
    if len(value) > MAX_MESSAGES:
        raise ValueError(f"at most {MAX_MESSAGES} items, got {len(value)}")
    out = []
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in _ITEM_TYPES:
            raise ValueError(f"item {i} is {kind!r}: only {', '.join(_ITEM_TYPES)} items are supported here")
        for part in item.get("content") if kind == "message" and isinstance(item.get("content"), list) else ():
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                found = part.get("type") if isinstance(part, dict) else part
                raise ValueError(f"item {i}: only text content parts are supported (got {found!r})")
        out.append({"type": kind, **item})
    return out


class FunctionTool(BaseModel):
    """A function the answer may call (the Responses API declares it flat, not under ``function``)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedTool(BaseModel):
    type: Literal["function"]
    name: StrictStr


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: StrictStr | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat = TextFormat()


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    input: Annotated[
        Text | list[Annotated[InputMessage | FunctionCallItem | FunctionCallOutput, Field(discriminator="type")]],
        BeforeValidator(_items),
    ]
    instructions: Text | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | StrictInt = 1.0
    top_p: StrictFloat | StrictInt = 1.0
    stream: StrictBool = False
    text: TextConfig | None = None
    # Not in OpenAI's API (its Responses take no seed), as vLLM's: a seeded sampled answer is reproducible
    seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED)
    dartspec: DartspecOptions | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: StrictBool = True
    previous_response_id: StrictStr | None = None
    store: StrictBool = True
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def logprobs(self) -> bool:
        """Whether the answer's text comes with each token's log-probability (``include``)."""
        return LOGPROBS_INCLUDE in (self.include or ())

    def conversation(self, previous: Sequence[Message] = ()) -> list[Message]:
        """The conversation so far without ``instructions``: ``previous`` (a stored response's) and ``input``."""
        messages = [Message(role="user", content=self.input)] if isinstance(self.input, str) else _messages(self.input)
        if not messages:
            raise FieldError("input must not be empty", "input")
        return [*previous, *messages]

    def as_chat(self, conversation: Sequence[Message] | None = None) -> ChatRequest:
        """The chat completion request of ``conversation`` (default: :meth:`conversation` without a previous
        response) and the same settings (a :class:`FieldError` names what this server does not do)."""
        messages = list(self.conversation() if conversation is None else conversation)
        unknown = [name for name in self.include or () if name != LOGPROBS_INCLUDE]
        if unknown:
            raise FieldError(f"include: only {LOGPROBS_INCLUDE!r} is supported here (got {unknown[0]!r})", "include")
        if self.instructions is not None:
            messages.insert(0, Message(role="system", content=self.instructions))
        fmt = (self.text or TextConfig()).format
        response_format: dict[str, Any] | None = None
        if fmt.type == "json_object":
            response_format = {"type": "json_object"}
        elif fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise FieldError("text.format json_schema needs a schema", "text.format.schema")
            spec = {"name": fmt.name or "answer", "schema": fmt.schema_, "strict": fmt.strict}
            response_format = {"type": "json_schema", "json_schema": spec}
        tools = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in self.tools or []
        ]
        choice: Any = self.tool_choice
        if isinstance(choice, NamedTool):
            choice = {"type": "function", "function": {"name": choice.name}}
        try:
            return ChatRequest(
                model=self.model,
                messages=messages,
                tools=tools or None,
                tool_choice=choice,
                parallel_tool_calls=self.parallel_tool_calls,
                max_tokens=self.max_output_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                stream=self.stream,
                seed=self.seed,
                response_format=response_format,
                dartspec=self.dartspec,
                logprobs=self.logprobs or None,
                top_logprobs=self.top_logprobs if self.logprobs else None,
            )
        except ValidationError as err:  # a tool's name or parameters: the field as this API names it
            first = err.errors()[0]
            loc = [str(x) for x in first.get("loc", ())]
            where = f"tools.{loc[1]}.{loc[-1]}" if loc[:1] == ["tools"] and len(loc) > 2 else "input"
            raise FieldError(f"{where}: {first.get('msg', 'invalid')}", where) from None

    def echo(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them."""
        fmt = (self.text or TextConfig()).format
        shown: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            shown |= {"name": fmt.name or "answer", "schema": fmt.schema_, "strict": fmt.strict}
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "text": {"format": shown},
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "tool_choice": self.tool_choice.model_dump()
            if isinstance(self.tool_choice, NamedTool)
            else self.tool_choice or "auto",
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            "top_logprobs": self.top_logprobs,
            "metadata": {},
            "truncation": "disabled",
        }


def _messages(items: list[Any]) -> list[Message]:
    """Input items as chat messages: a run of calls is one assistant turn's ``tool_calls``, a result a tool message."""
    out: list[Message] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if out and out[-1].role == "assistant" and out[-1].tool_calls and out[-1].content is None:
                out[-1].tool_calls.append(call)
            else:
                out.append(Message(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutput):
            out.append(Message(role="tool", content=item.output, tool_call_id=item.call_id))
        else:
            out.append(Message(role=item.role, content=item.text()))
    return out


def output_messages(output: list[dict[str, Any]]) -> list[Message]:
    """A response's output items as the assistant turn that a next request's conversation holds."""
    calls = [
        ToolCall(id=item["call_id"], function=FunctionCall(name=item["name"], arguments=item["arguments"]))
        for item in output
        if item["type"] == "function_call"
    ]
    if calls:
        return [Message(role="assistant", content=None, tool_calls=calls)]
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    return [Message(role="assistant", content=text)]


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as it was answered
    conversation: list[Message]  # what a next response continues: its input after the earlier ones', its output


class ResponseStore:
    """Finished responses, in memory: the newest ``max_count`` (0: none), the oldest forgotten first."""

    def __init__(self, max_count: int) -> None:
        if max_count < 0:
            raise ValueError(f"max_count must be >= 0 (got {max_count})")
        self.max_count = max_count
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, body: dict[str, Any], conversation: list[Message]) -> None:
        """Keep a finished response (``body["id"]``) and the conversation it ends: ``conversation`` (its input, after
        the earlier responses') and its output."""
        if self.max_count == 0:
            return
        self._items[body["id"]] = StoredResponse(body, [*conversation, *output_messages(body["output"])])
        while len(self._items) > self.max_count:
            self._items.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None


def _status(result: GenerationResult | None) -> str:
    if result is None:
        return "in_progress"
    return "incomplete" if result.finish_reason == "length" else "completed"


def _message(rid: str, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A text answer's output item: the assistant message (its id follows from the response's); ``logprobs``: its
    tokens' (chat completions' ``logprobs.content`` entries), where asked for."""
    content = [] if text is None else [_part(text, logprobs)]
    return {"type": "message", "id": "msg_" + rid.removeprefix("resp_"), "status": status, "role": "assistant",
            "content": content}  # fmt: skip


def _call(call: dict[str, Any], arguments: str | None = None, status: str = "completed") -> dict[str, Any]:
    """A call's output item, from chat completions' ``tool_calls`` entry (``arguments``: as streamed so far)."""
    function = call["function"]
    return {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] if arguments is None else arguments,
        "status": status,
    }


def output_items(
    rid: str, text: str, result: GenerationResult, calls: str | None, logprobs: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """A finished answer's output: its calls where it is whole calls (``calls``: the request's call mode), else the
    message (a call cut short included: what there is, as text; with ``logprobs`` where asked for)."""
    made = tool_calls(text) if calls and result.finish_reason == "stop" else None
    return [_call(c) for c in made] if made is not None else [_message(rid, text, _status(result), logprobs)]


def response_body(
    rid: str,
    model: str,
    echo: dict[str, Any],
    output: list[dict[str, Any]],
    result: GenerationResult | None,
    usage: dict[str, Any] | None,
    created: int | None = None,
) -> dict[str, Any]:
    """A response object (``result`` None while it is in progress); ``usage`` is chat completions'
    (:func:`dartspec.serve.schema.usage`), renamed as this API names it."""
    status = _status(result)
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()) if created is None else created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        "usage": None
        if usage is None
        else {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
            "dartspec": usage["dartspec"],
        },
        **echo,
    }


class ResponseEvents:
    """A streamed response's events (the :class:`dartspec.serve.app.StreamFormat` of this API): each one
    ``event: TYPE`` and ``data: {"type", "sequence_number", ...}``. A text answer's message opens with its first
    text, each step's text a ``output_text.delta`` (with dartspec's count of its tokens and of those that came from
    accepted drafts); where the answer may be calls (``calls``: "auto" or "required") one starting as JSON is held
    back and sent whole, each call an output item with its arguments in one delta."""

    def __init__(
        self,
        rid: str,
        model: str,
        echo: dict[str, Any],
        calls: str | None = None,
        keep: Callable[[dict[str, Any]], None] | None = None,
        logprobs: Callable[[list[TokenLogprob]], Awaitable[list[dict[str, Any]]]] | None = None,
    ) -> None:
        """``keep``: called with the finished response object (to store it). ``logprobs``: where asked for, turns a
        step's tokens' log-probabilities into the API's entries."""
        self.rid, self.model, self.echo, self.calls, self.keep = rid, model, echo, calls, keep
        self.to_logprobs = logprobs
        self.logprobs: list[dict[str, Any]] | None = [] if logprobs is not None else None
        self.created = int(time.time())
        self.item = "msg_" + rid.removeprefix("resp_")
        self.sequence = 0
        self.text = ""
        self.kind: str | None = "call" if calls == "required" else None  # "text" or "call", once known
        self.opened = False  # the message's item and content part are out

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def _response(self, output: list[dict[str, Any]], result: GenerationResult | None, usage: dict | None) -> dict:
        return response_body(self.rid, self.model, self.echo, output, result, usage, self.created)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item, "output_index": 0, "content_index": 0}

    def _open(self) -> list[str]:
        """The message's item and content part, once."""
        if self.opened:
            return []
        self.opened = True
        return [
            self._event("response.output_item.added", output_index=0, item=_message(self.rid, None, "in_progress")),
            self._event("response.content_part.added", **self._where(), part=_part("")),
        ]

    def opening(self) -> list[str]:
        pending = self._response([], None, None)
        return [
            self._event("response.created", response=pending),
            self._event("response.in_progress", response=pending),
        ]

    async def step(self, index: int, ev: StepEvent) -> list[str]:
        if not ev.text:
            return []
        self.text += ev.text
        if self.kind is None:
            self.kind = "call" if self.calls and ev.text.startswith(("{", "[")) else "text"
        step_logprobs: list[dict[str, Any]] = []
        if self.to_logprobs is not None and self.logprobs is not None and ev.logprobs:
            step_logprobs = await self.to_logprobs(ev.logprobs)
            self.logprobs += step_logprobs
        if self.kind == "call":
            return []  # sent whole once it is
        counts = {"tokens": len(ev.token_ids), "drafted": ev.drafted}
        opened = self._open()  # (events numbered in the order they go out)
        delta = self._event(
            "response.output_text.delta", **self._where(), delta=ev.text, logprobs=step_logprobs, dartspec=counts
        )
        return [*opened, delta]

    def finished(self, index: int, result: GenerationResult, total: dict[str, Any] | None) -> list[str]:
        output = output_items(self.rid, self.text, result, self.calls, self.logprobs)
        done = self._response(output, result, total)
        events: list[str] = []
        if output[0]["type"] == "function_call":
            for i, item in enumerate(output):
                call_id, arguments = item["id"], item["arguments"]
                opened = {**item, "arguments": "", "status": "in_progress"}
                events += [
                    self._event("response.output_item.added", output_index=i, item=opened),
                    self._event(
                        "response.function_call_arguments.delta", item_id=call_id, output_index=i, delta=arguments
                    ),
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=call_id,
                        output_index=i,
                        name=item["name"],
                        arguments=arguments,
                    ),
                    self._event("response.output_item.done", output_index=i, item=item),
                ]
        else:
            events += self._open()
            held = self.logprobs or []
            if self.kind == "call" and self.text:  # a call cut short, held back so far: what there is, as text
                events.append(
                    self._event("response.output_text.delta", **self._where(), delta=self.text, logprobs=held)
                )
            events += [
                self._event("response.output_text.done", **self._where(), text=self.text, logprobs=held),
                self._event("response.content_part.done", **self._where(), part=_part(self.text, self.logprobs)),
                self._event("response.output_item.done", output_index=0, item=output[0]),
            ]
        if self.keep is not None:
            self.keep(done)
        return [*events, self._event(f"response.{done['status']}", response=done)]

    def closing(self) -> list[str]:
        return []

    def failed(self, message: str, kind: str, code: str) -> str:
        return self._event("error", code=code, message=message, param=None)


def _part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    return part if logprobs is None else {**part, "logprobs": logprobs}
