"""The server's view of generation: one request at a time, a bounded wait list, cancellation.

Speculative decoding here runs at batch 1, so requests take turns on the engine. A request waits for
its turn in arrival order; beyond ``max_queue`` waiting requests it is refused at once (the HTTP layer
answers 429). Generation runs in a worker thread so the event loop keeps serving other clients, and
every step checks a cancel flag: a client that disconnects, or a request that runs past its timeout,
frees the engine for the next one within one target forward.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dartspec.engine import GenerationResult, Generator, StepEvent
from dartspec.errors import DartspecError
from dartspec.serve.metrics import Metrics


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
    seed: int | None = None
    stop: Sequence[str] = ()
    plain: bool = False  # run without the drafter (the web page's comparison switch)
    cancel: threading.Event = field(default_factory=threading.Event)


class ServeEngine:
    """Owns the generators and hands the engine to one request at a time."""

    def __init__(
        self,
        speculative: Generator,
        plain: Generator,
        model_name: str,
        *,
        max_queue: int = 64,
        timeout_s: float = 600.0,
        metrics: Metrics | None = None,
    ) -> None:
        if max_queue < 0:
            raise DartspecError(f"the queue limit must be >= 0, got {max_queue}")
        if not timeout_s > 0:
            raise DartspecError(f"the request timeout must be positive, got {timeout_s}")
        self.speculative = speculative
        self.plain = plain
        self.target = speculative.target
        self.model_name = model_name
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.metrics = metrics or Metrics()
        self._turn: asyncio.Lock | None = None
        self._waiting = 0

    @property
    def drafter_name(self) -> str:
        """The speculative generator's drafter (``none`` when serving plain decoding)."""
        return self.speculative.drafter.name

    def _lock(self) -> asyncio.Lock:
        if self._turn is None:  # created lazily: it must belong to the server's event loop
            self._turn = asyncio.Lock()
        return self._turn

    async def run(self, job: Job) -> AsyncIterator[StepEvent]:
        """Yield the job's step events; raises QueueFull or GenerationTimeout.

        Closing the iterator early (client gone) cancels the generation.
        """
        # max_queue counts requests *waiting*: 0 serves a request when the engine is free and refuses it otherwise.
        if self._lock().locked() and self._waiting >= self.max_queue:
            self.metrics.rejected.inc()
            raise QueueFull(f"{self._waiting} requests are already waiting (limit {self.max_queue})")
        # The timeout covers the wait for a turn as well as the generation.
        deadline = time.monotonic() + self.timeout_s
        self._waiting += 1
        try:
            await asyncio.wait_for(self._lock().acquire(), timeout=self.timeout_s)
        except TimeoutError:
            self.metrics.timeouts.inc()
            raise GenerationTimeout(f"waited past the server's {self.timeout_s:g} s timeout for a turn") from None
        finally:
            self._waiting -= 1
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()
        worker = threading.Thread(target=self._work, args=(job, loop, events), daemon=True)
        self.metrics.in_flight.inc()
        try:
            worker.start()
        except BaseException:
            self._release()
            raise
        try:
            while True:
                try:
                    item = await asyncio.wait_for(events.get(), timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    job.cancel.set()
                    self.metrics.timeouts.inc()
                    raise GenerationTimeout(f"generation ran past the server's {self.timeout_s:g} s timeout") from None
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    return
                yield item
        finally:
            # No await here: a cancelled request (client gone) may not wait on anything. The worker
            # sees the flag within one step and hands the engine on itself (see _work).
            job.cancel.set()

    def _release(self) -> None:
        self.metrics.in_flight.dec()
        self._lock().release()

    def _work(self, job: Job, loop: asyncio.AbstractEventLoop, events: asyncio.Queue[Any]) -> None:
        gen = self.plain if job.plain else self.speculative
        stream = gen.stream(
            job.prompt_ids,
            max_new_tokens=job.max_tokens,
            temperature=job.temperature,
            top_p=job.top_p,
            seed=job.seed,
            stop=job.stop,
        )
        try:
            for event in stream:
                if job.cancel.is_set():
                    self.metrics.cancelled.inc()
                    break
                if event.result is not None:
                    self.metrics.record(event.result, drafter="none" if job.plain else self.drafter_name)
                loop.call_soon_threadsafe(events.put_nowait, event)
        except BaseException as err:  # handed to the request, which turns it into an HTTP error
            loop.call_soon_threadsafe(events.put_nowait, err)
        else:
            loop.call_soon_threadsafe(events.put_nowait, None)
        finally:
            stream.close()
            # The engine is free only once this thread has left the generation loop.
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._release)

    async def complete(self, job: Job) -> tuple[str, GenerationResult]:
        """Run a job to the end; returns its text and result."""
        result = None
        async for event in self.run(job):
            if event.result is not None:
                result = event.result
        assert result is not None
        return result.text, result
