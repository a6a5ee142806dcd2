"""OpenAI-compatible HTTP API (FastAPI) over a :class:`~dartspec.serve.engine.ServeEngine`.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream: true`` gives server-sent
events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus) and the web demo at ``/``. Errors use OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from dartspec.engine import GenerationResult
from dartspec.errors import DartspecError
from dartspec.serve.engine import GenerationTimeout, Job, QueueFull, ServeEngine


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: StrictStr


class DartspecOptions(BaseModel):
    """dartspec's own request field: ``{"drafter": "none"}`` runs the request with plain decoding."""

    drafter: Literal["default", "none"] = "default"


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | StrictInt = 1.0
    top_p: StrictFloat | StrictInt = 1.0
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    n: StrictInt = 1
    dartspec: DartspecOptions | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Common):
    prompt: StrictStr


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    code = {400: "invalid_request", 401: "invalid_api_key", 429: "rate_limit_exceeded", 504: "timeout"}.get(status)
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def create_app(engine: ServeEngine, *, api_key: str | None = None, default_max_tokens: int = 256) -> FastAPI:
    """The FastAPI application; ``api_key`` (if set) is required as ``Authorization: Bearer KEY``."""
    app = FastAPI(title="dartspec", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON")
        where = ".".join(loc) or None
        return error_response(400, f"{where or 'body'}: {err.get('msg', 'invalid value')}", param=where)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(401, "invalid API key", kind="authentication_error")
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": engine.model_name, "drafter": engine.drafter_name}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "dartspec"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return resources.files("dartspec.serve").joinpath("static/index.html").read_text(encoding="utf-8")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        try:
            ids = engine.target.encode_chat([m.model_dump() for m in req.messages])
        except DartspecError as err:
            return error_response(400, str(err))
        return await _serve(req, ids, chat=True, request=request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        if not req.prompt:
            return error_response(400, "prompt must not be empty", param="prompt")
        return await _serve(req, engine.target.encode(req.prompt), chat=False, request=request)

    async def _serve(req: _Common, ids: list[int], *, chat: bool, request: Request):
        problem = _check(req, ids)
        if problem:
            return error_response(400, problem[0], param=problem[1])
        job = Job(
            prompt_ids=ids,
            max_tokens=req.max_completion_tokens or req.max_tokens or default_max_tokens,
            temperature=float(req.temperature),
            top_p=float(req.top_p),
            seed=req.seed,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            plain=bool(req.dartspec and req.dartspec.drafter == "none"),
        )
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if req.stream:
            events = engine.run(job)
            try:  # start the generation now, so a full queue is a 429 and not a broken stream
                first = await anext(events)
            except QueueFull as err:
                return error_response(429, str(err), kind="rate_limit_error")
            except GenerationTimeout as err:
                return error_response(504, str(err), kind="timeout_error")
            except StopAsyncIteration:
                first = None
            return StreamingResponse(_sse(rid, chat, first, events, job, request), media_type="text/event-stream")
        try:
            text, result = await engine.complete(job)
        except QueueFull as err:
            return error_response(429, str(err), kind="rate_limit_error")
        except GenerationTimeout as err:
            return error_response(504, str(err), kind="timeout_error")
        choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": engine.model_name,
            "choices": [choice],
            "usage": _usage(result),
        }

    def _check(req: _Common, ids: list[int]) -> tuple[str, str] | None:
        if req.n != 1:
            return "only n=1 is supported", "n"
        if not 0 <= req.temperature <= 2:
            return f"temperature must be between 0 and 2, got {req.temperature}", "temperature"
        if not 0 < req.top_p <= 1:
            return f"top_p must be in (0, 1], got {req.top_p}", "top_p"
        if isinstance(req.stop, list) and len(req.stop) > 4:
            return "at most 4 stop sequences", "stop"
        if len(ids) >= engine.target.max_context:
            return (
                f"the prompt is {len(ids)} tokens but {engine.model_name} has a context window of "
                f"{engine.target.max_context} tokens",
                "messages",
            )
        return None

    async def _sse(rid: str, chat: bool, first, events: AsyncIterator, job: Job, request: Request):
        created = int(time.time())

        def chunk(text: str, finish: str | None, ev=None, usage=None) -> str:
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {}}
            else:
                choice = {"index": 0, "text": text}
            choice["finish_reason"] = finish
            body: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": engine.model_name,
                "choices": [choice],
            }
            if ev is not None:
                # dartspec's extra: how many of this step's tokens came from accepted drafts.
                body["dartspec"] = {"tokens": len(ev.token_ids), "drafted": ev.drafted}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                yield f"data: {json.dumps(_role_chunk(rid, created, engine.model_name))}\n\n"
            pending = [first] if first is not None else []
            while True:
                if pending:
                    ev = pending.pop()
                else:
                    try:
                        ev = await anext(events)
                    except StopAsyncIteration:
                        break
                if await request.is_disconnected():
                    job.cancel.set()
                    break
                if ev.text or ev.result is None:
                    yield chunk(ev.text, None, ev)
                if ev.result is not None:
                    yield chunk("", ev.result.finish_reason, usage=_usage(ev.result))
            yield "data: [DONE]\n\n"
        except GenerationTimeout as err:
            payload = {"error": {"message": str(err), "type": "timeout_error", "param": None, "code": "timeout"}}
            yield f"data: {json.dumps(payload)}\n\n"
        finally:
            job.cancel.set()
            await events.aclose()

    return app


def _role_chunk(rid: str, created: int, model: str) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
    }


def _usage(result: GenerationResult) -> dict[str, Any]:
    s = result.stats
    return {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.new_tokens,
        "total_tokens": s.prompt_tokens + s.new_tokens,
        "dartspec": {
            "target_forwards": s.target_forwards,
            "accepted_draft_tokens": s.draft_tokens_accepted,
            "tau": round(s.tau, 4),
            "tokens_per_s": round(s.tokens_per_s, 2),
        },
    }
