"""The OpenAI wire format the server speaks: request bodies (validated by pydantic), error objects, and the
pieces of an answer (streamed chunks, usage with dartspec's own extra fields)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from dartspec.constraint import RESPONSE_FORMATS, ResponseFormat
from dartspec.engine import MAX_TOP_LOGPROBS, GenerationResult, StepEvent, TokenLogprob
from dartspec.errors import DartspecError, FieldError
from dartspec.json_grammar import Grammar
from dartspec.json_schema import compile_schema
from dartspec.sampling import MAX_PENALTY, Penalties

MAX_MESSAGES = 256
#: vLLM's guided-decoding fields, and their limits (a request's pattern and choices must stay small)
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice")
MAX_GUIDED_CHARS = 10_000
MAX_GUIDED_CHOICES = 1_000
MAX_TOOLS = 128
MAX_STOP_CHARS = 256
#: The most stop strings a request may give: OpenAI's API takes 4, vLLM any number, and lm-evaluation-harness sends a
#: task's own plus the model's EOS text (5 or more); each is searched for at every step.
MAX_STOPS = 32


def _encodable(text: str) -> str:
    """Text the tokenizer can take: a lone surrogate ("\\ud800" in JSON) is valid JSON but not Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains an unpaired surrogate: not valid Unicode text") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_encodable)]
StopText = Annotated[StrictStr, Field(max_length=MAX_STOP_CHARS), AfterValidator(_encodable)]


def _content(content: Any) -> str | list[dict[str, Any]] | None:
    """A message's content: a string, or a list of parts as newer OpenAI clients send it, text parts only (a model
    here reads no images). One validator, so a wrong part is named rather than "should be a valid string"."""
    if content is None:  # an assistant turn of tool calls only (Message checks)
        return None
    if isinstance(content, str):
        return _encodable(content)
    if not isinstance(content, list):
        raise ValueError("content must be a string or a list of text parts")
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"only text content parts are supported (got {kind!r})")
        if not isinstance(part.get("text"), str):
            raise ValueError("a text content part needs a 'text' string")
        _encodable(part["text"])
    return content


class FunctionCall(BaseModel):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call an earlier assistant turn made (sent back in the conversation)."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    # "developer" is OpenAI's newer name for the system role; "tool" carries a call's result.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Any, AfterValidator(_content)] = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls (its content may then be null)
    tool_call_id: StrictStr | None = None  # the call a "tool" message answers

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only for an assistant message with tool_calls)")
        return self

    def as_chat(self) -> dict[str, str]:
        """The message as the chat template takes it: a system role, one string (an assistant turn's calls as JSON
        in the shape it answered with: :func:`dartspec.serve.tools.calls_text`)."""
        from dartspec.serve.tools import calls_text

        if self.content is None:
            content = ""
        elif isinstance(self.content, str):
            content = self.content
        else:
            content = "".join(p["text"] for p in self.content)
        if self.tool_calls:
            content = (content + "\n" if content else "") + calls_text(self.tool_calls)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class FunctionDef(BaseModel):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments (none: no arguments)
    strict: StrictBool | None = None  # always in force here


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: StrictStr


class ToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (its guided-decoding fields since v0.12): one of a JSON Schema, a regular
    expression the whole answer matches, or texts of which the answer is one; its other kinds are refused by name."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | None = Field(default=None, alias="json")
    regex: StrictStr | None = Field(default=None, max_length=MAX_GUIDED_CHARS)
    choice: list[StrictStr] | None = Field(default=None, min_length=1, max_length=MAX_GUIDED_CHOICES)


class DartspecOptions(BaseModel):
    """dartspec's own request field: ``{"drafter": "none"}`` runs the request with plain decoding."""

    drafter: Literal["default", "none"] = "default"


#: The most choices one request may ask for (``n``): each is a sequence in the batch.
MAX_CHOICES = 8
#: The largest seed (a 64-bit signed integer, what torch's generators take).
MAX_SEED = 2**63 - 1


#: Fields of OpenAI's and vLLM's APIs this server does not implement, each with the values that ask for nothing (what
#: clients send when not asked otherwise). Any other value is refused naming the field, since the answer would not be
#: what was asked for; other unknown fields (``user``, ``stream_options``, ``metadata``, ...) change nothing here and
#: are ignored. A value, why it is refused where that is not just "not supported".
_UNIMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((None, False), ""),
    "guided_grammar": ((None,), ": use guided_json, guided_regex or guided_choice"),
    "guided_whitespace_pattern": ((None,), ""),
}
_UNIMPLEMENTED_CHAT = _UNIMPLEMENTED | {
    "functions": ((None,), ": it is OpenAI's deprecated function calling, send tools and tool_choice instead"),
    "function_call": ((None,), ": it is OpenAI's deprecated function calling, send tools and tool_choice instead"),
    "echo": ((None, False), ""),
    "chat_template": ((None,), ": the model's own template is used"),
}
#: What a chat template is rendered with by the server or by transformers' apply_chat_template itself: not for
#: chat_template_kwargs to set.
_TEMPLATE_OWN = frozenset(
    {
        "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
        "tokenize", "chat_template", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding",
        "truncation", "max_length", "return_tensors",
    }
)  # fmt: skip
_UNIMPLEMENTED_COMPLETION = _UNIMPLEMENTED


def _unimplemented(
    extra: dict[str, Any] | None, table: dict[str, tuple[tuple[Any, ...], str]]
) -> tuple[str, str] | None:
    for field, value in (extra or {}).items():
        if field in table:
            harmless, why = table[field]
            # by type too: 0 == False and 1 == True, but 0 is no "off" for a field that takes a list
            if not any(value == h and type(value) is type(h) for h in harmless):
                return f"{field} is not supported by this server{why}", field
    return None


class CommonRequest(BaseModel):
    # Unknown fields are kept (in model_extra) to be checked against _UNIMPLEMENTED, then ignored
    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | StrictInt = 1.0
    top_p: StrictFloat | StrictInt = 1.0
    # vLLM's sampling extensions: top_k (0 or -1 = off), min_p (0 = off), min_tokens (no EOS before), ignore_eos
    top_k: StrictInt = Field(default=0, ge=-1)
    min_p: StrictFloat | StrictInt = Field(default=0, ge=0, le=1)
    min_tokens: StrictInt = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None  # vLLM's: tokens that end the answer as EOS does
    include_stop_str_in_output: StrictBool = False  # vLLM's: the text ends after the stop string
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=1)  # vLLM's: only the prompt's last k tokens
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's: only these tokens can be chosen
    # vLLM's: each prompt token's log-probability (after the first) with this many alternatives, in the answer's
    # prompt_logprobs (a completion's choices', a chat completion's own)
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's: tokens in log-probabilities named "token_id:ID", not by their text (which a token holding part of a
    # character does not have)
    return_tokens_as_token_ids: StrictBool = False
    bad_words: list[StrictStr] | None = None  # vLLM's: words the answer never contains
    skip_special_tokens: StrictBool = True  # vLLM's: False shows special tokens' text in the answer
    seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: StopText | list[StopText] | None = None
    stream: StrictBool = False
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)
    dartspec: DartspecOptions | None = None
    # Penalties and logit bias (dartspec.sampling.Penalties; repetition_penalty is vLLM's extension); token ids as
    # strings in logit_bias, as OpenAI's clients send them
    presence_penalty: StrictFloat | StrictInt = Field(default=0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: StrictFloat | StrictInt = Field(default=0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: StrictFloat | StrictInt = Field(default=1, gt=0)
    logit_bias: dict[str, StrictFloat | StrictInt] | None = None
    # {"type": "text"}, {"type": "json_object"} (a JSON object) or {"type": "json_schema", "json_schema": {"name": ...,
    # "schema": {...}}} (a document the schema admits), decoded under dartspec.constraint
    response_format: dict[str, Any] | None = None
    # vLLM's guided decoding (clients send them in extra_body): a JSON Schema, a regular expression the whole answer
    # matches (ECMA-262, dartspec.json_pattern) or texts of which the answer is one
    guided_json: dict[str, Any] | None = None
    guided_regex: StrictStr | None = Field(default=None, max_length=MAX_GUIDED_CHARS)
    guided_choice: list[StrictStr] | None = Field(default=None, min_length=1, max_length=MAX_GUIDED_CHOICES)
    structured_outputs: StructuredOutputs | None = None

    def logprobs_asked(self) -> int | None:
        """Alternatives per token's log-probabilities the request asks for, or None: none (each endpoint's fields)."""
        return None

    def prompt_scored(self) -> int | None:
        """Alternatives per prompt token's log-probabilities the request needs, or None: none (vLLM's
        ``prompt_logprobs``; a completion's ``echo`` with ``logprobs``)."""
        return self.prompt_logprobs

    def unsupported(self) -> tuple[str, str] | None:
        """(why, the field) for an OpenAI or vLLM field this server does not implement that would change the answer,
        or None: such a field is refused, not ignored (each endpoint's table)."""
        return _unimplemented(self.model_extra, _UNIMPLEMENTED)

    def guided(self) -> list[tuple[str, str, Any]]:
        """vLLM's guided-decoding fields given (``guided_*`` and ``structured_outputs``): (the field, "json", "regex"
        or "choice", its value)."""
        out = [(name, name.removeprefix("guided_"), getattr(self, name)) for name in GUIDED_FIELDS]
        outputs = self.structured_outputs or StructuredOutputs()
        kinds = (("json", outputs.json_schema), ("regex", outputs.regex), ("choice", outputs.choice))
        out += [(f"structured_outputs.{what}", what, value) for what, value in kinds]
        return [(field, what, value) for field, what, value in out if value is not None]

    def answer_format(self) -> ResponseFormat:
        """The answer's format: "text", "json_object", a JSON Schema, or the grammar of a guided regex or choice (a
        :class:`DartspecError` for others, or for more than one of them)."""
        kind = (self.response_format or {}).get("type", "text")
        guided = self.guided()
        given = (["response_format"] if kind != "text" else []) + [field for field, _, _ in guided]
        if len(given) > 1:
            raise FieldError(f"{given[0]} and {given[1]} exclude each other (one answer format)", given[1])
        if guided:
            field, what, value = guided[0]
            try:
                if what == "regex":
                    return Grammar.regex(value)
                return Grammar.choice(value) if what == "choice" else compile_schema(value)
            except DartspecError as err:  # a pattern or schema it cannot follow
                raise FieldError(f"{field}: {err}", field) from None
        if kind == "json_schema":
            spec = self.response_format.get("json_schema")  # type: ignore[union-attr]
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
                raise DartspecError("response_format json_schema needs json_schema: {name, schema: {...}}")
            if spec["schema"] is False:
                raise DartspecError("the JSON schema false admits no document")
            return spec["schema"] if isinstance(spec["schema"], dict) else {}  # true: any JSON value
        if kind not in RESPONSE_FORMATS:
            raise DartspecError(
                f"response_format type {kind!r} is not supported by this server (text, json_object and json_schema are)"
            )
        return str(kind)

    def penalties(self) -> Penalties:
        """The request's penalties and logit bias, checked (a :class:`DartspecError` says what is wrong)."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise DartspecError(f'logit_bias keys must be token ids (e.g. "50256"), got {key!r}')
            bias.append((int(key), value))
        penalties = (self.repetition_penalty, self.presence_penalty, self.frequency_penalty, bias)
        return Penalties(*penalties, self.allowed_token_ids)  # type: ignore[arg-type]


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a ``prompt`` tokenized as ``/v1/completions`` takes it, or chat ``messages`` through
    the model's chat template as ``/v1/chat/completions`` takes them (with ``chat_template_kwargs``)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: Text | None = None
    messages: list[Message] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids back to text (special tokens included, so that it undoes
    ``/tokenize``)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[StrictInt] = Field(max_length=1_000_000)


#: The most alternatives a completion's ``logprobs`` asks for (OpenAI's limit for the legacy endpoint).
MAX_COMPLETION_LOGPROBS = 5


class ChatRequest(CommonRequest):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    # Each token's log-probability, with top_logprobs alternatives (OpenAI's chat fields)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Function calling (dartspec.serve.tools): the answer is a call ("required" or a named function), a call or text
    # ("auto", the default with tools) or text ("none")
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    # vLLM's: more variables for the model's chat template (e.g. Qwen3's {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the assistant turn opened after the messages (the default), or the last (assistant) message continued
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False

    def template_flags(self) -> dict[str, bool]:
        """How the conversation ends in the template (``continue_final_message`` implies no generation prompt; both
        given true is refused as vLLM refuses it)."""
        opened = self.add_generation_prompt and not self.continue_final_message
        return {"add_generation_prompt": opened, "continue_final_message": self.continue_final_message}

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> tuple[str, str] | None:
        if self.continue_final_message:
            if "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
                return "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
            if self.messages[-1].role != "assistant":
                return "continue_final_message needs the last message to be the assistant's", "continue_final_message"
        for key in self.chat_template_kwargs or {}:
            if not key.isidentifier() or key in _TEMPLATE_OWN:
                why = "is set by the server" if key in _TEMPLATE_OWN else "is no template variable name"
                return f"chat_template_kwargs: {key!r} {why}", "chat_template_kwargs"
        return _unimplemented(self.model_extra, _UNIMPLEMENTED_CHAT)

    def answer_format(self) -> ResponseFormat:
        """The grammar of a call where the answer may be one (:mod:`dartspec.serve.tools`), else the response
        format."""
        from dartspec.serve.tools import ToolError, call_grammar, call_mode

        if call_mode(self) is None:
            return super().answer_format()
        fields = ["response_format"] if (self.response_format or {}).get("type", "text") != "text" else []
        fields += [field for field, _, _ in self.guided()]
        if fields:
            raise ToolError(
                f'{fields[0]} cannot be combined with tools that may be called (tool_choice "none" can)', fields[0]
            )
        return call_grammar(self)


#: The most prompts one completion request may batch (each with its n choices, all sequences in the batch).
MAX_PROMPTS = 64


class CompletionRequest(CommonRequest):
    # Text or token ids (OpenAI's and vLLM's array of tokens), or a batch of either: each prompt's n choices in turn
    prompt: Text | list[StrictInt] | list[Text] | list[list[StrictInt]]
    # 0 only with echo: the prompt scored, nothing generated (OpenAI's legacy way to score a text)
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    # OpenAI's legacy field: each token's log-probability with this many alternatives
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    # OpenAI's legacy best n of best_of answers: only best_of = n (each answer its own best) is what this server does
    best_of: StrictInt | None = Field(default=None, ge=1)
    # The prompt before the answer in the text (and its tokens' log-probabilities before the answer's, with logprobs)
    echo: StrictBool = False
    # The text after the insertion: the answer is the middle between prompt and suffix (models with FIM tokens)
    suffix: Text | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one text or token-id list, or the batch given."""
        batched = isinstance(self.prompt, list) and bool(self.prompt) and not isinstance(self.prompt[0], int)
        return list(self.prompt) if batched else [self.prompt]  # type: ignore[list-item]

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix and self.echo:
            return "echo cannot be combined with a suffix (the prompt is then an infilling template)", "suffix"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens 0 asks for no answer: it scores the prompt with echo (and logprobs) only", "max_tokens"
        return self._unsupported()

    def prompt_scored(self) -> int | None:
        echoed = self.logprobs if self.echo else None
        asked = [k for k in (echoed, self.prompt_logprobs) if k is not None]
        if not asked and self.max_tokens == 0:  # an echo of the prompt alone: a scoring prefill, nothing shown of it
            return 0
        return max(asked) if asked else None

    def _unsupported(self) -> tuple[str, str] | None:
        if self.best_of is not None and self.best_of != self.n:
            return f"best_of is not supported by this server (only best_of = n, here {self.n})", "best_of"
        return _unimplemented(self.model_extra, _UNIMPLEMENTED_COMPLETION)


def logprobs_body(
    logprobs: Sequence[TokenLogprob], chat: bool, token_text: Callable[[int], str], offset: int = 0
) -> dict[str, Any]:
    """Tokens' log-probabilities in OpenAI's shape: for chat ``{"content": [{"token", "logprob", "bytes",
    "top_logprobs"}]}``, for completions ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (offsets
    from ``offset``, the characters of the answer before these tokens). A token's text is its id decoded alone, its
    bytes that text's UTF-8 (a token holding part of a character shows U+FFFD)."""
    texts = {t: token_text(t) for lp in logprobs for t in (lp.token_id, *(i for i, _ in lp.top))}
    if chat:

        def entry(token: int, value: float) -> dict[str, Any]:
            return {"token": texts[token], "logprob": value, "bytes": list(texts[token].encode("utf-8"))}

        content = [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs
        ]
        return {"content": content}
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(texts[lp.token_id])
    return {
        "tokens": [texts[lp.token_id] for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{texts[t]: v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def _top(logprobs: Sequence[TokenLogprob], top: int) -> list[TokenLogprob]:
    """``logprobs`` with at most ``top`` alternatives each (one request's fields may ask for different counts)."""
    return [lp if len(lp.top) <= top else replace(lp, top=lp.top[:top]) for lp in logprobs]


def echo_logprobs_body(
    prompt_ids: Sequence[int],
    scored: Sequence[TokenLogprob],
    top: int,
    answer: Sequence[TokenLogprob],
    token_text: Callable[[int], str],
) -> dict[str, Any]:
    """A completion's ``logprobs`` with ``echo``: the prompt's tokens (the first has no log-probability and no
    alternatives: null) then the answer's, offsets running on through both, ``top`` alternatives each."""
    first = token_text(prompt_ids[0])
    prompt = logprobs_body(_top(scored, top), False, token_text, len(first))
    offset = prompt["text_offset"][-1] + len(prompt["tokens"][-1]) if scored else len(first)
    tail = logprobs_body(_top(answer, top), False, token_text, offset)
    return {
        "tokens": [first, *prompt["tokens"], *tail["tokens"]],
        "token_logprobs": [None, *prompt["token_logprobs"], *tail["token_logprobs"]],
        "top_logprobs": [None, *prompt["top_logprobs"], *tail["top_logprobs"]],
        "text_offset": [0, *prompt["text_offset"], *tail["text_offset"]],
    }


def prompt_logprobs_body(
    scored: Sequence[TokenLogprob], top: int, token_text: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: null for the prompt's first token, then for each later one ``{token id: {"logprob",
    "rank", "decoded_token"}}`` of the token itself and its position's ``top`` most likely tokens."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for lp in scored:
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": token_text(lp.token_id)}}
        for rank, (token, value) in enumerate(lp.top[:top], 1):
            entry.setdefault(str(token), {"logprob": value, "rank": rank, "decoded_token": token_text(token)})
        out.append(entry)
    return out


def error_body(message: str, kind: str, param: str | None, code: str | None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    """An OpenAI-shaped JSON error with its HTTP status."""
    code = {
        400: "invalid_request",
        401: "invalid_api_key",
        404: "model_not_found",
        413: "request_too_large",
        429: "rate_limit_exceeded",
        500: "internal_error",
        504: "timeout",
    }.get(status)
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def role_chunk(rid: str, created: int, model: str, index: int = 0) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
    }


def usage(*results: GenerationResult, choices: int = 1) -> dict[str, Any]:
    """OpenAI's usage of a request's answers (each prompt counted once, for its ``choices`` answers), and dartspec's
    figures over all of them (tokens per second: all their tokens over the longest one's time, as they decoded
    together)."""
    stats = [r.stats for r in results]
    prompt, completion = sum(s.prompt_tokens for s in stats) // choices, sum(s.new_tokens for s in stats)
    forwards, seconds = sum(s.target_forwards for s in stats), max(s.seconds for s in stats)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "dartspec": {
            "target_forwards": forwards,
            "accepted_draft_tokens": sum(s.draft_tokens_accepted for s in stats),
            "tau": round(completion / forwards if forwards else 0.0, 4),
            "tokens_per_s": round(completion / seconds if seconds > 0 else 0.0, 2),
        },
    }


def chunk(
    model: str,
    rid: str,
    created: int,
    chat: bool,
    text: str,
    finish: str | None,
    ev: StepEvent | None = None,
    usage: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    tool_calls: list[dict[str, Any]] | None = None,
    prompt_logprobs: list[Any] | None = None,
) -> str:
    """One server-sent event of a streamed answer's choice ``index`` (``logprobs``: of its tokens, where the request
    asked; ``prompt_logprobs``: vLLM's, in the choice's first event, the choice's in a completion and the chunk's in
    a chat completion, as in their whole answers)."""
    if tool_calls:
        choice: dict[str, Any] = {
            "index": index,
            "delta": {"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls)]},
        }
    elif chat:
        choice = {"index": index, "delta": {"content": text} if text else {}}
    else:
        choice = {"index": index, "text": text}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    if prompt_logprobs is not None and not chat:
        choice["prompt_logprobs"] = prompt_logprobs
    choice["finish_reason"] = finish
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if ev is not None:
        # dartspec's extra: how many of this step's tokens came from accepted drafts.
        body["dartspec"] = {"tokens": len(ev.token_ids), "drafted": ev.drafted}
    if usage is not None:
        body["usage"] = usage
    if prompt_logprobs is not None and chat:
        body["prompt_logprobs"] = prompt_logprobs
    return f"data: {json.dumps(body)}\n\n"
