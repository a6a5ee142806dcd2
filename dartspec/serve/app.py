"""OpenAI-compatible HTTP API (FastAPI) over a :class:`~dartspec.serve.engine.ServeEngine`.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream: true`` gives server-sent
events ending in ``data: [DONE]``), ``POST /v1/responses`` (OpenAI's Responses API, text answers:
:mod:`dartspec.serve.responses`), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus) and the web
demo at ``/``. Errors use OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any, Protocol, TypeVar

import jinja2
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from dartspec.constraint import response_grammar
from dartspec.engine import GenerationResult, StepEvent, TokenLogprob, check_stop_token_ids, check_token_ids
from dartspec.errors import DartspecError, FieldError
from dartspec.infill import infill_prompt
from dartspec.sampling import Penalties, bad_word_tokens
from dartspec.serve.engine import GenerationTimeout, Job, QueueFull, ServeEngine
from dartspec.serve.responses import ResponseEvents, ResponsesRequest, ResponseStore, output_items, response_body
from dartspec.serve.schema import (
    MAX_PROMPTS,
    MAX_SEED,
    MAX_STOPS,
    ChatRequest,
    CommonRequest,
    CompletionRequest,
    DetokenizeRequest,
    Message,
    TokenizeRequest,
    chunk,
    echo_logprobs_body,
    error_body,
    error_response,
    is_union_tag,
    logprobs_body,
    prompt_logprobs_body,
    role_chunk,
    usage,
)
from dartspec.serve.tools import call_mode, tool_calls, with_tools

log = logging.getLogger("dartspec.serve")
T = TypeVar("T")
#: How often a request that waits (queued, or generating without streaming) checks for its client.
DISCONNECT_POLL_S = 0.2
#: Default limit of a request body: a full 8K-token context is ~40 KB of text.
MAX_BODY_BYTES = 1 << 20


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def unless_gone(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``, cancelling it (and raising :class:`ClientGone`) if the client disconnects first.

    A request that waits in the queue, or for a non-streamed answer, sends nothing the server could
    notice failing; without this a client that gave up would still get its full generation, holding the
    engine from the requests behind it. Cancelling the task releases the queue slot, or sets the job's
    cancel flag, which stops the worker within one step (see :meth:`ServeEngine.run`).
    """
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            # wait() neither raises the task's outcome nor swallows a cancellation of this handler.
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved, so asyncio does not log it: nobody is left to tell


class BodyLimitMiddleware:
    """Refuses request bodies over ``limit`` bytes with a 413 before anything parses them.

    The body is read here (at most ``limit`` + one chunk) and handed on whole; after it, ``receive`` is the
    client's own again, so a disconnect still reaches the endpoint.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        too_large = error_response(413, f"the request body is over {self.limit} bytes", param=None)
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left: the endpoint will see it
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer KEY`` on ``/v1/`` (the page, health and metrics stay open unless
    ``everything``: then only ``/health`` does).

    A plain ASGI middleware on purpose: Starlette's ``BaseHTTPMiddleware`` (``@app.middleware``) hides
    client disconnects from the endpoints, and the server relies on seeing them to free the engine.
    """

    def __init__(self, app: ASGIApp, api_key: str, everything: bool = False) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.everything = everything

    def _guarded(self, path: str) -> bool:
        return path != "/health" if self.everything else path.startswith("/v1/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._guarded(scope["path"]):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                await error_response(401, "invalid API key", kind="authentication_error")(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class Served:
    """What the routes need, kept on ``app.state.dartspec`` (a route is a module function, not a closure)."""

    engine: ServeEngine
    names: frozenset[str]
    default_max_tokens: int
    responses: ResponseStore  # finished Responses API answers, for previous_response_id and GET / DELETE
    # Tokenizing a long prompt takes a while: off the event loop (so /health and streams stay live), in one
    # thread because a fast tokenizer must not be used from two threads at once.
    tokenizer_thread: ThreadPoolExecutor

    async def tokenized(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, *args)

    def _token_text(self, token: int) -> str:
        return self.engine.target.tokenizer.decode([token], skip_special_tokens=False)

    async def logprobs(
        self,
        logprobs: list[TokenLogprob],
        chat: bool,
        offset: int = 0,
        echo: Echo | None = None,
        as_ids: bool = False,
    ) -> dict[str, Any]:
        """OpenAI's logprobs object of these tokens (their texts decoded on the tokenizer's thread); with ``echo``
        (the prompt's ids and log-probabilities, and the alternatives asked for) the prompt's tokens first;
        ``as_ids``: each token as ``"token_id:ID"`` (vLLM's ``return_tokens_as_token_ids``)."""
        text = _token_id if as_ids else self._token_text
        if echo is None:
            return await self.tokenized(logprobs_body, logprobs, chat, text, offset)
        ids, scored, top = echo
        return await self.tokenized(echo_logprobs_body, ids, scored, top, logprobs, text)

    async def prompt_logprobs(self, scored: list[TokenLogprob] | None, top: int, as_ids: bool = False) -> list[Any]:
        """vLLM's ``prompt_logprobs`` of a prompt (decoded on the tokenizer's thread; ``as_ids`` as for
        :meth:`logprobs`)."""
        assert scored is not None  # asked for, so the engine took them
        return await self.tokenized(prompt_logprobs_body, scored, top, _token_id if as_ids else self._token_text)


def _token_id(token: int) -> str:
    """A token as vLLM's ``return_tokens_as_token_ids`` names it (a token holding part of a character has no text of
    its own)."""
    return f"token_id:{token}"


#: A completion's echoed prompt for its ``logprobs``: its token ids, their log-probabilities (after the first) and how
#: many alternatives were asked for.
Echo = tuple[list[int], list[TokenLogprob] | None, int]


def create_app(
    engine: ServeEngine,
    *,
    api_key: str | None = None,
    protect_all: bool = False,
    default_max_tokens: int = 256,
    max_body_bytes: int = MAX_BODY_BYTES,
    aliases: tuple[str, ...] = (),
    max_stored_responses: int = 1000,
) -> FastAPI:
    """The FastAPI application; ``api_key`` (if set) is required as ``Authorization: Bearer KEY`` on ``/v1/``
    (everywhere but ``/health`` with ``protect_all``); a request's ``model`` must be the served model's name or
    one of ``aliases`` (or absent). The Responses API keeps the newest ``max_stored_responses`` answers."""
    app = FastAPI(title="dartspec", docs_url=None, redoc_url=None)
    app.state.dartspec = Served(
        engine=engine,
        names=frozenset({engine.model_name, *aliases}),
        default_max_tokens=default_max_tokens,
        responses=ResponseStore(max_stored_responses),
        tokenizer_thread=ThreadPoolExecutor(max_workers=1, thread_name_prefix="dartspec-tokenize"),
    )
    app.include_router(routes)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _crash)
    # Added last = outermost: the key is checked before a large body is read.
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, everything=protect_all)
    return app


def _served(request: Request) -> Served:
    return request.app.state.dartspec


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    err = exc.errors()[0] if exc.errors() else {}
    # Pydantic also names the union member that failed ("temperature.float", "stop.list[str].0");
    # clients know fields and list indices only.
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not is_union_tag(x)]
    if err.get("type") == "json_invalid":
        return error_response(400, "the request body is not valid JSON")
    # "body: Input should be a valid dictionary": the body is no JSON object
    if not loc and err.get("type") in ("model_attributes_type", "dict_type"):
        ctype = request.headers.get("content-type", "")
        hint = "" if "json" in ctype else f" (its Content-Type was {ctype or 'missing'}: send application/json)"
        return error_response(400, f"the request body must be a JSON object{hint}")
    where = ".".join(loc) or None
    return error_response(400, f"{where or 'body'}: {err.get('msg', 'invalid value')}", param=where)


async def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    # FastAPI's own refusals (a body it cannot decode, an unknown path) in the shape clients parse.
    body = error_body(str(exc.detail), "invalid_request_error", None, None)
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _crash(request: Request, exc: Exception) -> JSONResponse:
    # A bug or a failing model must still answer in the shape clients parse, not as a bare 500 page.
    log.exception("request failed")
    # The client gets no internal text (paths, library messages); the server log has the details.
    return error_response(500, "internal error: the server log has the details", kind="server_error")


routes = APIRouter()


@routes.get("/health")
async def health(request: Request) -> dict[str, Any]:
    engine = _served(request).engine
    return {"status": "ok", "model": engine.model_name, "drafter": engine.drafter_name}


@routes.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    card = {"id": _served(request).engine.model_name, "object": "model", "created": 0, "owned_by": "dartspec"}
    return {"object": "list", "data": [card]}


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_served(request).engine.metrics.exposition(), media_type="text/plain; version=0.0.4")


@routes.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request):
    """vLLM's: the token ids a prompt or a conversation is decoded from, and the context window."""
    served = _served(request)
    if (refused := _unknown_model(served, req)) is not None:
        return refused
    if req.messages is not None:
        flags = {
            k: getattr(req, k) for k in ("add_generation_prompt", "continue_final_message") if k in req.model_fields_set
        }
        chat = ChatRequest(messages=req.messages, chat_template_kwargs=req.chat_template_kwargs, **flags)
        if (problem := chat.unsupported()) is not None:
            return error_response(400, problem[0], param=problem[1])
        ids = await _chat_ids(served, chat, "messages")
        if isinstance(ids, Response):
            return ids
    else:
        ids = await served.tokenized(served.engine.target.encode, req.prompt)
    return {"count": len(ids), "max_model_len": served.engine.target.max_context, "tokens": ids}


@routes.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    """vLLM's: the text of token ids."""
    served = _served(request)
    if (refused := _unknown_model(served, req)) is not None:
        return refused
    if (refused := _token_ids_refused(served, req.tokens, "tokens")) is not None:
        return refused
    decode = functools.partial(served.engine.target.tokenizer.decode, skip_special_tokens=False)
    text = await served.tokenized(decode, req.tokens)
    return {"prompt": text}


@routes.get("/", response_class=HTMLResponse)
async def index() -> str:
    return resources.files("dartspec.serve").joinpath("static/index.html").read_text(encoding="utf-8")


@routes.post("/v1/chat/completions")
async def chat(req: ChatRequest, request: Request):
    served = _served(request)
    if (refused := _unknown_model(served, req)) is not None:
        return refused
    ids = await _chat_ids(served, req, "messages")
    if isinstance(ids, Response):
        return ids
    return await _serve(served, req, [ids], chat=True, request=request)


@routes.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    """OpenAI's Responses API for text answers (:mod:`dartspec.serve.responses`): the same generation as a chat
    completion of the same conversation and settings."""
    served = _served(request)
    previous: list[Message] = []
    if body.previous_response_id is not None:
        stored = served.responses.get(body.previous_response_id)
        if stored is None:
            return error_response(404, _not_stored(served, body.previous_response_id), param="previous_response_id")
        previous = stored.conversation
    try:
        conversation = body.conversation(previous)
        req = body.as_chat(conversation)
    except FieldError as err:
        return error_response(400, str(err), param=err.param)
    if (refused := _unknown_model(served, req)) is not None:
        return refused
    ids = await _chat_ids(served, req, "input")
    if isinstance(ids, Response):
        return ids
    run = await _start(
        served,
        req,
        [ids],
        prompt_param="input",
        request=request,
        format_param="text.format",
        limit_param="max_output_tokens",
    )
    if isinstance(run, Response):
        return run
    rid, model, calls = f"resp_{uuid.uuid4().hex[:24]}", served.engine.model_name, _calls(req)

    def keep(done: dict[str, Any]) -> None:
        if body.store:
            served.responses.put(done, conversation)

    async def entries(logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
        return (await served.logprobs(logprobs, chat=True))["content"]

    if run.starts is not None:
        events = ResponseEvents(rid, model, body.echo(), calls, keep, entries if body.logprobs else None)
        return StreamingResponse(_sse(events, run.starts, run.jobs, request), media_type="text/event-stream")
    assert run.outs is not None
    ((text, result),) = run.outs
    logprobs = await entries(result.logprobs) if body.logprobs and result.logprobs is not None else None
    output = output_items(rid, text, result, calls, logprobs)
    done = response_body(rid, model, body.echo(), output, result, usage(result))
    keep(done)
    return done


def _not_stored(served: Served, rid: str) -> str:
    kept = served.responses.max_count
    return (
        f"no stored response {rid!r}: this server keeps the newest {kept} finished responses in memory, "
        "not those asked with store: false"
        if kept
        else f"no stored response {rid!r}: this server keeps none (serve --max-stored-responses 0)"
    )


@routes.get("/v1/responses/{rid}")
async def get_response(rid: str, request: Request):
    """A stored response, as it was answered."""
    served = _served(request)
    stored = served.responses.get(rid)
    return stored.body if stored is not None else error_response(404, _not_stored(served, rid), param="response_id")


@routes.delete("/v1/responses/{rid}")
async def delete_response(rid: str, request: Request):
    """Forget a stored response (a later previous_response_id naming it is refused)."""
    served = _served(request)
    if not served.responses.delete(rid):
        return error_response(404, _not_stored(served, rid), param="response_id")
    return {"id": rid, "object": "response", "deleted": True}


async def _chat_ids(served: Served, req: ChatRequest, param: str) -> list[int] | Response:
    """The request's conversation through the model's chat template, tokenized; a 400 naming ``param`` where the
    template refuses it."""
    try:
        messages = with_tools([m.as_chat() for m in req.messages], req)
        encode = functools.partial(served.engine.target.encode_chat, **req.template_flags())
        return await served.tokenized(encode, messages, req.chat_template_kwargs)
    except FieldError as err:
        return error_response(400, str(err), param=err.param)
    except DartspecError as err:
        return error_response(400, str(err))
    except jinja2.TemplateError as err:  # the template's own refusal (e.g. roles that must alternate)
        return error_response(400, f"the model's chat template refused these messages: {err}", param=param)


@routes.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    served = _served(request)
    if (refused := _unknown_model(served, req)) is not None:
        return refused
    if (problem := req.unsupported()) is not None:  # before the prompts are made (a suffix makes them otherwise)
        return error_response(400, problem[0], param=problem[1])
    prompts = req.prompts()
    if len(prompts) * req.n > MAX_PROMPTS:
        return error_response(400, f"at most {MAX_PROMPTS} answers a request (prompts x n)", param="prompt")
    batch, texts = [], []
    for prompt in prompts:
        if not prompt:
            return error_response(400, "prompt must not be empty", param="prompt")
        if isinstance(prompt, list) and (refused := _token_ids_refused(served, prompt, "prompt")) is not None:
            return refused  # token ids, decoded from as they are
        if req.suffix:  # fill in the middle: the prompt is the text before the insertion
            try:
                batch.append(await served.tokenized(infill_prompt, served.engine.target, prompt, req.suffix))
            except DartspecError as err:
                return error_response(400, str(err), param="suffix")
        elif isinstance(prompt, list):
            batch.append(list(prompt))
        else:
            batch.append(await served.tokenized(served.engine.target.encode, prompt))
        texts.append(prompt if isinstance(prompt, str) and req.truncate_prompt_tokens is None else None)
    return await _serve(served, req, batch, chat=False, request=request, echo=texts if req.echo else None)


def _token_ids_refused(served: Served, ids: list[int], field: str) -> JSONResponse | None:
    """A 400 naming ``field`` where one of ``ids`` is no token id of the served model."""
    try:
        check_token_ids(ids, served.engine.target.vocab_size, served.engine.model_name, field)
    except DartspecError as err:
        return error_response(400, str(err), param=field)
    return None


def _unknown_model(served: Served, req: CommonRequest | TokenizeRequest | DetokenizeRequest) -> JSONResponse | None:
    if req.model is None or req.model in served.names:
        return None
    names = ", ".join(sorted(served.names))
    return error_response(404, f"the model {req.model!r} is not served here (this server has: {names})", param="model")


@dataclass
class _Run:
    """A request's generations, started: each choice's first event and the rest (streamed), or each one's text and
    result (whole)."""

    jobs: list[Job]
    starts: list[tuple[StepEvent | None, AsyncIterator[StepEvent]]] | None = None
    outs: list[tuple[str, GenerationResult]] | None = None


async def _start(
    served: Served,
    req: CommonRequest,
    prompts: list[list[int]],
    *,
    prompt_param: str,
    request: Request,
    format_param: str = "response_format",
    limit_param: str = "max_tokens",
) -> _Run | Response:
    """Check the request, make its answer's grammar and jobs (``n`` for each of the ``prompts``, in turn), and run
    them: streamed (started, so that a full queue is a 429 and not a broken stream) or to the end; an error answer
    where any of that fails (its ``param`` the prompt's or the answer format's field as the endpoint names them)."""
    engine = served.engine
    if req.truncate_prompt_tokens is not None:  # vLLM's left truncation (of the templated text, for a chat)
        prompts = [ids[-req.truncate_prompt_tokens :] for ids in prompts]
    for ids in prompts:
        problem = _check(engine, req, ids, prompt_param, limit_param)
        if problem:
            return error_response(400, problem[0], param=problem[1])
    try:  # the answer's grammar, made once for all the request's choices
        grammar = response_grammar(req.answer_format(), req.min_tokens)
    except FieldError as err:  # a tool's or a guided field's (the field named)
        return error_response(400, str(err), param=err.param)
    except DartspecError as err:
        param = "min_tokens" if "min_tokens" in str(err) else format_param
        return error_response(400, str(err), param=param)
    bad_words: tuple[tuple[int, ...], ...] = ()
    if req.bad_words is not None:
        try:  # on the tokenizer's thread (a fast tokenizer must not run in two threads at once)
            encode = functools.partial(engine.target.encode, add_special_tokens=False)
            bad_words = await served.tokenized(bad_word_tokens, req.bad_words, encode)
            Penalties(bad_words=bad_words).check_vocabulary(engine.target.vocab_size, engine.model_name)
            if bad_words and grammar is not None:  # the grammar could leave no token that is not banned
                msg = "bad_words cannot be combined with a structured answer (JSON, a regex or a choice)"
                raise DartspecError(msg)
        except DartspecError as err:
            return error_response(400, str(err), param="bad_words")
    asked = req.max_completion_tokens or req.max_tokens  # None: the server's default (0: the prompt scored alone)
    base = Job(
        prompt_ids=[],
        max_tokens=served.default_max_tokens if asked is None else asked,
        temperature=float(req.temperature),
        top_p=float(req.top_p),
        top_k=max(req.top_k, 0),
        min_p=float(req.min_p),
        seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        plain=bool(req.dartspec and req.dartspec.drafter == "none"),
        logprobs=req.logprobs_asked(),
        prompt_logprobs=req.prompt_scored(),
        penalties=req.penalties(),
        response_format="text" if grammar is None else grammar,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        bad_words=bad_words,
        skip_special_tokens=req.skip_special_tokens,
    )
    # n choices are n sequences in the batch; a seeded request's choice i samples with seed + i (reproducible, and
    # not n copies of one answer), an unseeded one's each with its own draw
    jobs = [
        replace(base, prompt_ids=ids, seed=None if req.seed is None else req.seed + i, cancel=threading.Event())
        for ids in prompts
        for i in range(req.n)
    ]
    if req.stream:
        streams = [engine.run(job) for job in jobs]
        starting = [asyncio.ensure_future(_first(events)) for events in streams]
        try:  # start the generations now, so a full queue is a 429 and not a broken stream
            firsts = await unless_gone(request, asyncio.gather(*starting))
        except Exception as err:
            for task in starting:  # the other choices' starts end first (a generator cannot close mid-step)
                task.cancel()
            await asyncio.wait(starting)
            for events in streams:
                await events.aclose()
            return _failure(err)
        return _Run(jobs, starts=list(zip(firsts, streams, strict=True)))
    tasks = [asyncio.ensure_future(engine.complete(job)) for job in jobs]
    try:
        outs = await unless_gone(request, asyncio.gather(*tasks))
    except Exception as err:
        for task in tasks:  # a choice that failed ends the others (their runs cancel their jobs)
            task.cancel()
        await asyncio.wait(tasks)
        return _failure(err)
    return _Run(jobs, outs=list(outs))


async def _serve(
    served: Served,
    req: CommonRequest,
    prompts: list[list[int]],
    *,
    chat: bool,
    request: Request,
    echo: list[str | None] | None = None,
) -> Response | dict[str, Any]:
    """A chat completion or a completion (of each of ``prompts``, ``n`` choices each): started, then answered in
    their shapes. ``echo``: a completion's answers start with their prompt's text (None: its tokens decoded), and
    their log-probabilities with the prompt's tokens'."""
    run = await _start(served, req, prompts, prompt_param="messages" if chat else "prompt", request=request)
    if isinstance(run, Response):
        return run
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    echoes = None
    if echo is not None:  # each choice's
        decode = served.engine.target.decode
        texts = [
            t if t is not None else await served.tokenized(decode, job.prompt_ids)
            for t, job in zip(echo, run.jobs[:: req.n], strict=True)
        ]
        echoes = [texts[i // req.n] for i in range(len(run.jobs))]
    if run.starts is not None:
        chunks = _Chunks(
            served,
            rid,
            chat,
            run.jobs,
            _calls(req),
            echoes,
            req.logprobs_asked(),
            req.prompt_logprobs,
            req.return_tokens_as_token_ids,
        )
        stream = _sse(chunks, run.starts, run.jobs, request, choices=req.n)
        return StreamingResponse(stream, media_type="text/event-stream")
    assert run.outs is not None
    outs, engine = run.outs, served.engine
    choices = []
    for index, (job, (text, result)) in enumerate(zip(run.jobs, outs, strict=True)):
        choice: dict[str, Any] = {"index": index, "finish_reason": result.finish_reason, "logprobs": None}
        if result.logprobs is not None:
            top = req.logprobs_asked() or 0
            prompt: Echo | None = None if echoes is None else (job.prompt_ids, result.prompt_logprobs, top)
            as_ids = req.return_tokens_as_token_ids
            choice["logprobs"] = await served.logprobs(result.logprobs, chat, echo=prompt, as_ids=as_ids)
        calls = tool_calls(text) if result.finish_reason == "stop" and _calls(req) else None
        if calls is not None:
            choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
            choice["finish_reason"] = "tool_calls"
        elif chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text if echoes is None else echoes[index] + text
            if req.prompt_logprobs is not None:  # vLLM's, a completion choice's own
                scored, top = result.prompt_logprobs, req.prompt_logprobs
                choice["prompt_logprobs"] = await served.prompt_logprobs(scored, top, req.return_tokens_as_token_ids)
        choices.append(choice)
    body = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": engine.model_name,
        "choices": choices,
        "usage": usage(*(result for _, result in outs), choices=req.n),
    }
    if chat and req.prompt_logprobs is not None:  # vLLM's, the chat completion's (one prompt for all choices)
        scored, top = outs[0][1].prompt_logprobs, req.prompt_logprobs
        body["prompt_logprobs"] = await served.prompt_logprobs(scored, top, req.return_tokens_as_token_ids)
    return body


def _calls(req: CommonRequest) -> str | None:
    """Whether the request's answers may be tool calls: "required", "auto" (a call or text), or None."""
    return call_mode(req) if isinstance(req, ChatRequest) else None


async def _first(events: AsyncIterator[StepEvent]) -> StepEvent | None:
    """A stream's first event (its prefill done), or None where it ended without one."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None


def _failure(err: Exception) -> Response:
    """The HTTP answer for a request whose generation did not finish."""
    if isinstance(err, QueueFull):
        return error_response(429, str(err), kind="rate_limit_error")
    if isinstance(err, GenerationTimeout):
        return error_response(504, str(err), kind="timeout_error")
    if isinstance(err, ClientGone):
        return Response(status_code=499)  # nginx's "client closed request": only logs ever see it
    if isinstance(err, DartspecError):  # what the engine rejects (e.g. settings it cannot honour)
        return error_response(400, str(err))
    raise err


def _check(
    engine: ServeEngine, req: CommonRequest, ids: list[int], prompt_param: str, limit_param: str
) -> tuple[str, str] | None:
    unsupported = req.unsupported()
    if unsupported:
        return unsupported
    if req.seed is not None and req.seed + req.n - 1 > MAX_SEED:
        most = MAX_SEED - req.n + 1
        return f"with n={req.n} the seed must be at most {most} (choice i samples with seed + i)", "seed"
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        return "top_logprobs needs logprobs: true", "top_logprobs"
    try:
        req.penalties().check_vocabulary(engine.target.vocab_size, engine.model_name)
    except DartspecError as err:  # the message names the field
        fields = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "allowed_token_ids")
        return str(err), next((f for f in fields if f in str(err)), "logit_bias")
    try:
        check_stop_token_ids(req.stop_token_ids or [], engine.target.vocab_size, engine.model_name)
    except DartspecError as err:
        return str(err), "stop_token_ids"
    if not 0 <= req.temperature <= 2:
        return f"temperature must be between 0 and 2, got {req.temperature}", "temperature"
    if not 0 < req.top_p <= 1:
        return f"top_p must be in (0, 1], got {req.top_p}", "top_p"
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOPS:
        return f"at most {MAX_STOPS} stop sequences, got {len(req.stop)}", "stop"
    if len(ids) >= engine.target.max_context:
        return (
            f"the prompt is {len(ids)} tokens but {engine.model_name} has a context window of "
            f"{engine.target.max_context} tokens",
            prompt_param,
        )
    asked = req.max_completion_tokens or req.max_tokens
    if asked is not None and len(ids) + asked > engine.target.max_context:
        # OpenAI's and vLLM's answer (a limit that cannot be reached is refused, not cut silently); without one the
        # answer may run to the end of the context window
        param = "max_completion_tokens" if req.max_completion_tokens and limit_param == "max_tokens" else limit_param
        return (
            f"{engine.model_name}'s context window is {engine.target.max_context} tokens, but {len(ids) + asked} "
            f"were asked for ({len(ids)} in the prompt, {asked} in the answer): ask for at most "
            f"{engine.target.max_context - len(ids)} with {param}",
            param,
        )
    return None


class StreamFormat(Protocol):
    """How a streamed answer is written as server-sent events (:func:`_sse` drives it): chat completions' and
    completions' chunks (:class:`_Chunks`), or the Responses API's events
    (:class:`dartspec.serve.responses.ResponseEvents`)."""

    def opening(self) -> list[str]:
        """The events before the first step."""
        ...

    async def step(self, index: int, ev: StepEvent) -> list[str]:
        """The events of one step of choice ``index``."""
        ...

    def finished(self, index: int, result: GenerationResult, total: dict[str, Any] | None) -> list[str]:
        """The events once choice ``index`` is done; ``total``: the usage of all, once the last one is."""
        ...

    def closing(self) -> list[str]:
        """The events after every choice is done."""
        ...

    def failed(self, message: str, kind: str, code: str) -> str:
        """The event of a generation that failed after the status line was sent."""
        ...


async def _sse(
    fmt: StreamFormat,
    starts: list[tuple[StepEvent | None, AsyncIterator[StepEvent]]],
    jobs: list[Job],
    request: Request,
    choices: int = 1,
) -> AsyncIterator[str]:
    """The server-sent events of a request's answers (``starts``: each one's first event and the rest; ``choices``
    of each prompt), in the order their steps come, written by ``fmt``; the jobs end with the stream, whatever ends
    it."""
    results: list[GenerationResult] = []
    events = _merged(starts)
    try:
        for text in fmt.opening():
            yield text
        async for index, ev in events:
            if await request.is_disconnected():
                break
            for text in await fmt.step(index, ev):
                yield text
            if ev.result is not None:
                results.append(ev.result)
                total = usage(*results, choices=choices) if len(results) == len(starts) else None
                for text in fmt.finished(index, ev.result, total):
                    yield text
        else:
            for text in fmt.closing():
                yield text
    except GenerationTimeout as err:
        # The status line is long gone: the error travels as an event, and the missing end tells clients the
        # answer is incomplete.
        yield fmt.failed(str(err), "timeout_error", "timeout")
    except Exception as err:
        log.exception("generation failed mid-stream")
        yield fmt.failed(f"internal error: {type(err).__name__}: {err}", "server_error", "internal_error")
    finally:
        for job in jobs:
            job.cancel.set()
        await events.aclose()


class _Chunks:
    """Chat completions' and completions' chunks (``data: [DONE]`` at the end). ``calls`` ("required" or "auto"):
    answers may be tool calls, each sent whole in one delta once it is (the steps of a call carry no content; with
    "auto" an answer is a call when its first text starts as one). ``echo``: each completion's prompt text, sent
    first (with its tokens' log-probabilities where ``top`` asks for the answer's); ``prompt_top``: vLLM's
    ``prompt_logprobs``, in each answer's first chunk; ``as_ids``: tokens named by id (vLLM's
    ``return_tokens_as_token_ids``)."""

    def __init__(
        self,
        served: Served,
        rid: str,
        chat: bool,
        jobs: list[Job],
        calls: str | None,
        echo: list[str] | None = None,
        top: int | None = None,
        prompt_top: int | None = None,
        as_ids: bool = False,
    ) -> None:
        self.served, self.rid, self.chat, self.calls = served, rid, chat, calls
        self.jobs, self.echo, self.top, self.prompt_top, self.as_ids = jobs, echo, top, prompt_top, as_ids
        self.created, self.model = int(time.time()), served.engine.model_name
        n = len(jobs)
        self.offsets = [0] * n  # a completion's offsets count the characters of its tokens so far
        self.is_call: list[bool | None] = [True if calls == "required" else None] * n  # known from the first text
        self.begun = [False] * n

    def opening(self) -> list[str]:
        if not self.chat:
            return []
        return [
            f"data: {json.dumps(role_chunk(self.rid, self.created, self.model, i))}\n\n"
            for i in range(len(self.offsets))
        ]

    async def step(self, index: int, ev: StepEvent) -> list[str]:
        first, self.begun[index] = not self.begun[index], True
        echo = self.echo[index] if first and self.echo is not None else ""
        scored = None
        if first and self.prompt_top is not None:
            scored = await self.served.prompt_logprobs(ev.prompt_logprobs, self.prompt_top, self.as_ids)
        # The last step may commit tokens that show no text (EOS); its chunk still counts them.
        if not (echo or scored or ev.text or ev.token_ids or ev.result is None):
            return []
        logprobs = None
        if ev.logprobs or (echo and ev.logprobs is not None):
            prompt = (self.jobs[index].prompt_ids, ev.prompt_logprobs, self.top or 0) if echo else None
            offset = self.offsets[index]
            logprobs = await self.served.logprobs(ev.logprobs, self.chat, offset, echo=prompt, as_ids=self.as_ids)
            self.offsets[index] += sum(len(t) for t in logprobs.get("tokens", ()))
        if self.calls and self.is_call[index] is None and ev.text:
            self.is_call[index] = ev.text.startswith(("{", "["))
        text = echo + ("" if self.is_call[index] else ev.text)
        return [
            chunk(
                self.model,
                self.rid,
                self.created,
                self.chat,
                text,
                None,
                ev,
                logprobs=logprobs,
                index=index,
                prompt_logprobs=scored,
            )
        ]

    def finished(self, index: int, result: GenerationResult, total: dict[str, Any] | None) -> list[str]:
        out, finish = [], result.finish_reason
        made = tool_calls(result.text) if self.is_call[index] and finish == "stop" else None
        if made is not None:
            out.append(chunk(self.model, self.rid, self.created, self.chat, "", None, tool_calls=made, index=index))
            finish = "tool_calls"
        elif self.is_call[index]:  # a call cut short (length, a stop string): what there is, as text
            out.append(chunk(self.model, self.rid, self.created, self.chat, result.text, None, index=index))
        out.append(chunk(self.model, self.rid, self.created, self.chat, "", finish, usage=total, index=index))
        return out

    def closing(self) -> list[str]:
        return ["data: [DONE]\n\n"]

    def failed(self, message: str, kind: str, code: str) -> str:
        return f"data: {json.dumps(error_body(message, kind, None, code))}\n\n"


async def _merged(
    starts: list[tuple[StepEvent | None, AsyncIterator[StepEvent]]],
) -> AsyncIterator[tuple[int, StepEvent]]:
    """``(choice, event)`` of every stream as it comes; a stream's error is raised here. Closing it ends them all."""
    queue: asyncio.Queue[tuple[int, StepEvent | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, first: StepEvent | None, events: AsyncIterator[StepEvent]) -> None:
        try:
            if first is not None:
                await queue.put((index, first))
            async for ev in events:
                await queue.put((index, ev))
            await queue.put((index, None))
        except Exception as err:
            await queue.put((index, err))
        finally:
            await events.aclose()

    tasks = [asyncio.create_task(pump(i, first, events)) for i, (first, events) in enumerate(starts)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
