"""OpenAI's Responses API (``POST /v1/responses``) for text answers, over the same generation as chat completions.

A request is turned into the chat completion of the same conversation (:meth:`ResponsesRequest.as_chat`:
``instructions`` as a system message, ``input`` a string or a list of messages, ``max_output_tokens``,
``temperature``, ``top_p``, ``text.format`` text / json_object / json_schema), so its answer is token for token the
chat completion's; what differs is the shape: a response object whose ``output`` is one assistant message, and, when
streamed, the API's typed events (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``,
or ``response.incomplete`` where ``max_output_tokens`` cut the answer). Responses are not stored: a
``previous_response_id`` is refused (send the conversation in ``input``), and so are tools (the chat completions
endpoint has them).
"""

from __future__ import annotations

import json
import time
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

from dartspec.engine import GenerationResult, StepEvent
from dartspec.errors import FieldError
from dartspec.serve.schema import MAX_MESSAGES, MAX_SEED, ChatRequest, DartspecOptions, Message, Text


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


def _items(value: Any) -> Any:
    """An input list's items checked for what this server reads (messages of text), so that a refusal names the
    item and what it is, rather than pydantic's first union member ("should be a valid string")."""
    if not isinstance(value, list):
        return value
    if len(value) > MAX_MESSAGES:
        raise ValueError(f"at most {MAX_MESSAGES} items, got {len(value)}")
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind != "message":
            raise ValueError(f"item {i} is {kind!r}: only message items (text) are supported here")
        for part in item.get("content") if isinstance(item.get("content"), list) else ():
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                found = part.get("type") if isinstance(part, dict) else part
                raise ValueError(f"item {i}: only text content parts are supported (got {found!r})")
    return value


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
    input: Annotated[Text | list[InputMessage], BeforeValidator(_items)]
    instructions: Text | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | StrictInt = 1.0
    top_p: StrictFloat | StrictInt = 1.0
    stream: StrictBool = False
    text: TextConfig | None = None
    # Not in OpenAI's API (its Responses take no seed), as vLLM's: a seeded sampled answer is reproducible
    seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED)
    dartspec: DartspecOptions | None = None
    tools: list[Any] | None = None
    previous_response_id: StrictStr | None = None

    def as_chat(self) -> ChatRequest:
        """The chat completion request of the same conversation and settings (a :class:`FieldError` names what this
        server does not do)."""
        if self.tools:
            raise FieldError("tools are not supported on /v1/responses here: /v1/chat/completions has them", "tools")
        if self.previous_response_id is not None:
            raise FieldError(
                "responses are not stored here: send the whole conversation in input", "previous_response_id"
            )
        turns = [("user", self.input)] if isinstance(self.input, str) else [(m.role, m.text()) for m in self.input]
        if not turns:
            raise FieldError("input must not be empty", "input")
        if self.instructions is not None:
            turns.insert(0, ("system", self.instructions))
        fmt = (self.text or TextConfig()).format
        response_format: dict[str, Any] | None = None
        if fmt.type == "json_object":
            response_format = {"type": "json_object"}
        elif fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise FieldError("text.format json_schema needs a schema", "text.format.schema")
            spec = {"name": fmt.name or "answer", "schema": fmt.schema_, "strict": fmt.strict}
            response_format = {"type": "json_schema", "json_schema": spec}
        try:
            return ChatRequest(
                model=self.model,
                messages=[Message(role=role, content=content) for role, content in turns],
                max_tokens=self.max_output_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                stream=self.stream,
                seed=self.seed,
                response_format=response_format,
                dartspec=self.dartspec,
            )
        except ValidationError as err:  # (the input's own checks ran above: what is left is its length with them)
            raise FieldError(f"input: {err.errors()[0].get('msg', 'invalid')}", "input") from None

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
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "store": False,
            "metadata": {},
            "truncation": "disabled",
        }


def _status(result: GenerationResult | None) -> str:
    if result is None:
        return "in_progress"
    return "incomplete" if result.finish_reason == "length" else "completed"


def _message(rid: str, text: str | None, status: str) -> dict[str, Any]:
    """The response's one output item: the assistant message (its id follows from the response's)."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": "msg_" + rid.removeprefix("resp_"), "status": status, "role": "assistant",
            "content": content}  # fmt: skip


def response_body(
    rid: str,
    model: str,
    echo: dict[str, Any],
    text: str | None,
    result: GenerationResult | None,
    usage: dict[str, Any] | None,
    created: int | None = None,
) -> dict[str, Any]:
    """A response object: ``text`` None and ``result`` None while it is in progress (no output yet); ``usage`` is
    chat completions' (:func:`dartspec.serve.schema.usage`), renamed as this API names it."""
    status = _status(result)
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()) if created is None else created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": [] if text is None else [_message(rid, text, status)],
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
    ``event: TYPE`` and ``data: {"type", "sequence_number", ...}``; a step's text is an ``output_text.delta`` (with
    dartspec's count of its tokens and of those that came from accepted drafts)."""

    def __init__(self, rid: str, model: str, echo: dict[str, Any]) -> None:
        self.rid, self.model, self.echo = rid, model, echo
        self.created = int(time.time())
        self.item = "msg_" + rid.removeprefix("resp_")
        self.sequence = 0
        self.text = ""

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def _response(self, text: str | None, result: GenerationResult | None, usage: dict[str, Any] | None) -> dict:
        return response_body(self.rid, self.model, self.echo, text, result, usage, self.created)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item, "output_index": 0, "content_index": 0}

    def opening(self) -> list[str]:
        pending = self._response(None, None, None)
        return [
            self._event("response.created", response=pending),
            self._event("response.in_progress", response=pending),
            self._event("response.output_item.added", output_index=0, item=_message(self.rid, None, "in_progress")),
            self._event("response.content_part.added", **self._where(), part=_part("")),
        ]

    async def step(self, index: int, ev: StepEvent) -> list[str]:
        if not ev.text:
            return []
        self.text += ev.text
        counts = {"tokens": len(ev.token_ids), "drafted": ev.drafted}
        return [self._event("response.output_text.delta", **self._where(), delta=ev.text, logprobs=[], dartspec=counts)]

    def finished(self, index: int, result: GenerationResult, total: dict[str, Any] | None) -> list[str]:
        done = self._response(self.text, result, total)
        return [
            self._event("response.output_text.done", **self._where(), text=self.text, logprobs=[]),
            self._event("response.content_part.done", **self._where(), part=_part(self.text)),
            self._event("response.output_item.done", output_index=0, item=done["output"][0]),
            self._event(f"response.{done['status']}", response=done),
        ]

    def closing(self) -> list[str]:
        return []

    def failed(self, message: str, kind: str, code: str) -> str:
        return self._event("error", code=code, message=message, param=None)


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}
