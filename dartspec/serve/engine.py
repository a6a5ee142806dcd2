"""The server's view of generation: continuous batching, a bounded wait list, cancellation.

Up to ``max_batch`` requests decode together: one scheduler thread steps them all with one target forward
per step (:meth:`dartspec.engine.Generator.advance_many`), each with its own KV cache, drafter, sampling and
stop strings. Requests join between steps (their prefill runs then) and leave when they finish, so a short
request never waits for a long one to end. ``step_rows`` caps the rows of a step: while the batch is small each
request drafts a tree, as it fills trees shrink to the root alone (plain decoding, where extra rows no longer
come free). Beyond the batch, requests wait in arrival order; beyond ``max_queue`` waiting requests one is
refused at once (the HTTP layer answers 429). Every step checks each request's cancel flag: a client that
disconnects, or a request that runs past its timeout, leaves the batch within one target forward without
disturbing the others.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dartspec.constraint import ResponseFormat
from dartspec.engine import GenerationResult, Generator, SequenceState, StepEvent
from dartspec.errors import DartspecError
from dartspec.prefix_cache import positions_read
from dartspec.runtime import on_cpu
from dartspec.sampling import Penalties
from dartspec.serve.metrics import Metrics


def default_step_rows(device: Any) -> int:
    """Rows of one batched step by default: on a CPU 4 (a verification of 4 rows costs 1.27x one row on SmolLM2
    and 8 rows 2x, BENCHMARKS.md: trees pay while the batch is small, plain decoding once it is larger); on a GPU
    64 (its verify cost is flat far beyond that)."""
    return 4 if on_cpu(device) else 64


async def next_event(events: asyncio.Queue[Any], deadline: float) -> Any:
    """The next item of ``events``; TimeoutError once the event loop's clock passes ``deadline``.

    Not ``asyncio.wait_for``: on Python 3.11 it returns the item instead of raising when the waiting task is
    cancelled just as an item arrives, and a step hands out an item every few milliseconds, so a client that
    disconnected now and then kept its generation running to the end (and the requests behind it waiting).
    """
    async with asyncio.timeout_at(deadline):
        return await events.get()


class QueueFull(Exception):
    """More requests are waiting than the server accepts."""


class GenerationTimeout(Exception):
    """A request ran past the server's timeout."""


@dataclass
class Job:
    """One request's generation settings."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    plain: bool = False  # run without the drafter (the web page's comparison switch)
    logprobs: int | None = None  # each token's log-probability with this many alternatives (None: none)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (max_tokens may then be 0)
    penalties: Penalties = field(default_factory=Penalties)
    response_format: ResponseFormat = "text"  # "json_object", a JSON Schema, or its grammar
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = ()
    include_stop_str_in_output: bool = False
    bad_words: Sequence[Sequence[int]] = ()  # vLLM's: words the answer never contains, tokenized
    skip_special_tokens: bool = True  # vLLM's: False shows special tokens' text
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _Request:
    """A job in the scheduler: where its events go, and its sequence once it decodes."""

    job: Job
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Any]
    generator: Generator | None = None
    seq: SequenceState | None = None

    def send(self, item: Any) -> None:
        """Hand a step event, an error or the end (None) to the request's coroutine."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed (server shutting down): nobody listens
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class ServeEngine:
    """Owns the generators and the scheduler that decodes the admitted requests together."""

    def __init__(
        self,
        speculative: Generator,
        plain: Generator,
        model_name: str,
        *,
        max_queue: int = 64,
        timeout_s: float = 600.0,
        max_batch: int = 8,
        step_rows: int | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """``max_batch``: requests decoded together (1: one at a time); ``step_rows``: rows of one batched step
        (None: :func:`default_step_rows` for the target's device)."""
        if max_queue < 0:
            raise DartspecError(f"the queue limit must be >= 0, got {max_queue}")
        if not timeout_s > 0:
            raise DartspecError(f"the request timeout must be positive, got {timeout_s}")
        if max_batch < 1:
            raise DartspecError(f"the batch size must be >= 1, got {max_batch}")
        if step_rows is not None and step_rows < 1:
            raise DartspecError(f"the rows of a step must be >= 1, got {step_rows}")
        if plain.target is not speculative.target:
            raise DartspecError("the plain and speculative generators must share one target")
        self.speculative = speculative
        self.plain = plain
        self.target = speculative.target
        self.model_name = model_name
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.max_batch = max_batch
        self.step_rows = default_step_rows(self.target.device) if step_rows is None else step_rows
        self.metrics = metrics or Metrics()
        self._wake = threading.Condition()
        self._pending: collections.deque[_Request] = collections.deque()
        self._running = 0  # requests admitted to the batch and not yet finished
        self._scheduler: threading.Thread | None = None

    @property
    def drafter_name(self) -> str:
        """The speculative generator's drafter (``none`` when serving plain decoding)."""
        return self.speculative.drafter.name

    async def run(self, job: Job) -> AsyncIterator[StepEvent]:
        """Yield the job's step events; raises QueueFull or GenerationTimeout.

        Closing the iterator early (client gone) cancels the generation.
        """
        # max_queue counts requests *waiting* for a place in the batch: 0 refuses any request the batch cannot take.
        with self._wake:
            if len(self._pending) + self._running >= self.max_batch + self.max_queue:
                self.metrics.rejected.inc()
                raise QueueFull(f"{len(self._pending)} requests are already waiting (limit {self.max_queue})")
            request = _Request(job, asyncio.get_running_loop(), asyncio.Queue())
            self._pending.append(request)
            self.metrics.waiting.set(len(self._pending))
            self._start_scheduler()
            self._wake.notify()
        # The timeout covers the wait for a place as well as the generation.
        deadline = request.loop.time() + self.timeout_s
        try:
            while True:
                try:
                    item = await next_event(request.events, deadline)
                except TimeoutError:
                    job.cancel.set()
                    self.metrics.timeouts.inc()
                    what = "generation ran past" if request.seq is not None else "waited past"
                    raise GenerationTimeout(f"{what} the server's {self.timeout_s:g} s timeout") from None
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    return
                yield item
        finally:
            # No await here: a cancelled request (client gone) may not wait on anything. A waiting request leaves the
            # wait list at once (its place goes to the next client); a running one is dropped by the scheduler,
            # which sees the flag before its next step.
            job.cancel.set()
            with self._wake:
                if request in self._pending:
                    self._pending.remove(request)
                    self.metrics.waiting.set(len(self._pending))

    def _start_scheduler(self) -> None:
        if self._scheduler is None or not self._scheduler.is_alive():
            self._scheduler = threading.Thread(target=self._schedule, name="dartspec-batch", daemon=True)
            self._scheduler.start()

    def _schedule(self) -> None:
        """The batch loop: admit waiting requests while there is room, step every running one, hand out events."""
        batch: list[_Request] = []
        while True:
            with self._wake:
                while not batch and not self._pending:
                    self._wake.wait()
                admitted = []
                while self._pending and len(batch) + len(admitted) < self.max_batch:
                    admitted.append(self._pending.popleft())
                self.metrics.waiting.set(len(self._pending))
                self._running += len(admitted)
            for request in admitted:
                if self._admit(request):
                    batch.append(request)
            batch = [r for r in batch if self._emit(r)]
            if not batch:
                continue
            self.metrics.step_batch.observe(len(batch))
            self._measure_kv(batch)
            try:
                self.speculative.advance_many([r.seq for r in batch], step_rows=self.step_rows)  # all admitted: seq set
            except BaseException as err:  # handed to every request of the step, which turns it into an HTTP error
                for request in batch:
                    request.send(err)
                    self._leave(request)
                batch = []

    def _measure_kv(self, batch: list[_Request]) -> None:
        """KV memory now, with and without the prefix cache's sharing (gauges of ``/metrics``)."""
        caches = [r.seq.cache for r in batch if r.seq is not None]
        shared = self.target.prefix_cache
        own = sum(c.own_bytes() for c in caches)
        self.metrics.kv_bytes.set(own + (shared.nbytes if shared is not None else 0))
        self.metrics.kv_bytes_unshared.set(sum(c.length * c.position_bytes() for c in caches))
        if caches:
            read, unshared = positions_read(caches, self.target.share_prefix_attention)
            self.metrics.kv_read.inc(read * caches[0].position_bytes())
            self.metrics.kv_read_unshared.inc(unshared * caches[0].position_bytes())
        if shared is not None:
            self.metrics.prefix_hit_tokens.set(shared.stats.hit_tokens)
            self.metrics.prefix_prompt_tokens.set(shared.stats.prompt_tokens)
            self.metrics.prefix_bytes.set(shared.nbytes)

    def _admit(self, request: _Request) -> bool:
        """Prefill a request and take its first token; False when it is not to run (cancelled meanwhile, error)."""
        job = request.job
        if job.cancel.is_set():  # gone while it waited
            self._leave(request, counted=False)
            return False
        request.generator = self.plain if job.plain else self.speculative
        try:
            request.seq = request.generator.start(
                job.prompt_ids,
                max_new_tokens=job.max_tokens,
                temperature=job.temperature,
                top_p=job.top_p,
                top_k=job.top_k,
                min_p=job.min_p,
                seed=job.seed,
                stop=job.stop,
                own_state=True,
                logprobs=job.logprobs,
                prompt_logprobs=job.prompt_logprobs,
                repetition_penalty=job.penalties.repetition,
                presence_penalty=job.penalties.presence,
                frequency_penalty=job.penalties.frequency,
                logit_bias=dict(job.penalties.logit_bias),
                allowed_token_ids=job.penalties.allowed,
                response_format=job.response_format,
                min_tokens=job.min_tokens,
                ignore_eos=job.ignore_eos,
                stop_token_ids=job.stop_token_ids,
                include_stop_str_in_output=job.include_stop_str_in_output,
                bad_words=job.bad_words,
                skip_special_tokens=job.skip_special_tokens,
            )
        except BaseException as err:
            request.send(err)
            self._leave(request, counted=False)
            return False
        self.metrics.in_flight.inc()
        return True

    def _emit(self, request: _Request) -> bool:
        """Hand the request what it has to show; False when it leaves the batch (finished or cancelled)."""
        assert request.seq is not None and request.generator is not None
        if request.job.cancel.is_set():
            self.metrics.cancelled.inc()
            self._leave(request)
            return False
        try:
            event = request.generator.emit(request.seq)
        except BaseException as err:
            request.send(err)
            self._leave(request)
            return False
        request.send(event)
        if event.result is None:
            return True
        self.metrics.record(event.result, drafter=event.result.stats.drafter)
        request.send(None)
        self._leave(request)
        return False

    def _leave(self, request: _Request | None = None, counted: bool = True) -> None:
        """A request's place in the batch is free (``counted``: it had been admitted and counted as in flight); its
        cache lets shared prefix blocks go now, not when the last reference to the request is dropped."""
        if request is not None and request.seq is not None:
            request.seq.cache.reset()
        if counted:
            self.metrics.in_flight.dec()
        with self._wake:
            self._running -= 1

    async def complete(self, job: Job) -> tuple[str, GenerationResult]:
        """Run a job to the end; returns its text and result."""
        result = None
        async for event in self.run(job):
            if event.result is not None:
                result = event.result
        assert result is not None
        return result.text, result
