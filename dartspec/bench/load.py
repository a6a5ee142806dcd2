"""``dartspec bench load``: many clients and hostile requests against a running server, on loopback.

A deployment must stay responsive while it is busy and while it is sent garbage. Against a server at ``url``
(``dartspec serve``), this:

1. answers each prompt once alone (greedy: the reference text);
2. sends ``requests`` well-formed chat requests from ``clients`` threads at once (half of them streamed), with
   hostile requests among them: an oversized body, malformed JSON, a lone surrogate, a seed out of range;
3. polls ``/health`` every 20 ms throughout.

It reports how many requests ran, the concurrency, the largest body sent, ``/health``'s worst and 99th-percentile
latency, what the hostile requests got (each should be a 4xx), and how many well-formed answers differ from
their lone run (greedy output must not depend on what else the server is doing). Every wait is bounded.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

#: Size of the oversized request's message (the server's default body limit is 1 MiB).
OVERSIZED_BYTES = 4 * 1024 * 1024


def hostile_bodies(model: str) -> dict[str, bytes]:
    """Raw request bodies a server must answer with a 4xx, never a 5xx or a hang."""
    big = json.dumps({"model": model, "messages": [{"role": "user", "content": "x" * OVERSIZED_BYTES}]})
    # json.dumps would escape the surrogate as text; a client that sends it raw is what the server must survive.
    surrogate = json.dumps({"model": model, "messages": [{"role": "user", "content": "SURROGATE"}]})
    surrogate = surrogate.replace("SURROGATE", "\\ud800")
    seed = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "seed": 2**70})
    return {
        "oversized body": big.encode(),
        "malformed JSON": b'{"model": "x", "messages": [',
        "lone surrogate": surrogate.encode(),
        "seed 2^70": seed.encode(),
    }


@dataclass
class LoadReport:
    requests: int = 0
    clients: int = 0
    completed: int = 0
    mismatches: int = 0
    failures: list[str] = field(default_factory=list)
    hostile: dict[str, int] = field(default_factory=dict)  # name -> HTTP status
    largest_body_bytes: int = 0
    health_checks: int = 0
    health_worst_ms: float = 0.0
    health_p99_ms: float = 0.0
    seconds: float = 0.0

    def markdown(self) -> str:
        hostile = ", ".join(f"{k} {v}" for k, v in self.hostile.items())
        return "\n".join(
            [
                "| requests | clients | completed | mismatches vs lone runs | largest body | /health worst (p99) | "
                "hostile requests | wall time |",
                "|---|---|---|---|---|---|---|---|",
                f"| {self.requests} | {self.clients} | {self.completed} | {self.mismatches} | "
                f"{self.largest_body_bytes / 2**20:.1f} MiB | {self.health_worst_ms:.0f} ms "
                f"({self.health_p99_ms:.0f} ms, {self.health_checks} checks) | {hostile} | {self.seconds:.1f} s |",
            ]
        )


def run_load(
    url: str,
    prompts: list[str],
    *,
    model: str,
    clients: int = 64,
    requests: int = 128,
    max_tokens: int = 32,
    api_key: str | None = None,
    timeout_s: float = 600.0,
) -> LoadReport:
    """Load ``url`` as described in the module docstring; ``prompts`` are cycled over the requests."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    report = LoadReport(requests=requests, clients=clients)

    def body(i: int, stream: bool) -> dict[str, Any]:
        content = prompts[i % len(prompts)]
        return {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }

    def ask(http: httpx.Client, i: int, stream: bool) -> str:
        left = max(1.0, deadline - time.monotonic())
        if not stream:
            r = http.post(f"{url}/v1/chat/completions", json=body(i, False), headers=headers, timeout=left)
            r.raise_for_status()
            return r.json()["choices"][0]["message"]["content"]
        parts = []
        with http.stream("POST", f"{url}/v1/chat/completions", json=body(i, True), headers=headers, timeout=left) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0].get("delta", {})
                    parts.append(delta.get("content") or "")
        return "".join(parts)

    start = time.monotonic()
    with httpx.Client() as http:
        lone = [ask(http, i, False) for i in range(min(len(prompts), requests))]

    latencies: list[float] = []
    stop = threading.Event()
    lock = threading.Lock()  # the report is shared by the client threads

    # Clients made up front and shared by the threads (httpx clients are thread-safe): making 64 of them at once
    # costs the client process enough to show up as /health latency that is not the server's.
    shared = httpx.Client(limits=httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8))
    health = httpx.Client()

    def poll_health() -> None:
        while not stop.is_set() and time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                health.get(f"{url}/health", timeout=5.0)
                latencies.append(time.perf_counter() - t0)
            except httpx.HTTPError:
                latencies.append(5.0)
            stop.wait(0.02)

    def one(i: int) -> None:
        try:
            text = ask(shared, i, stream=i % 2 == 1)
        except httpx.HTTPError as err:
            with lock:
                report.failures.append(f"request {i}: {type(err).__name__}: {err}")
            return
        with lock:
            report.completed += 1
            report.mismatches += text != lone[i % len(lone)]

    def hostile(name: str, raw: bytes) -> None:
        with lock:
            report.largest_body_bytes = max(report.largest_body_bytes, len(raw))
        try:
            r = shared.post(
                f"{url}/v1/chat/completions",
                content=raw,
                headers={**headers, "Content-Type": "application/json"},
                timeout=max(1.0, deadline - time.monotonic()),
            )
            status = r.status_code
        except httpx.HTTPError as err:  # e.g. the server closed the connection after its 413
            status = 0
            with lock:
                report.failures.append(f"{name}: {type(err).__name__}: {err}")
        with lock:
            report.hostile[name] = status

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    bad = hostile_bodies(model)
    # Exactly `clients` well-formed requests in flight (a server with a queue of that size never answers 429), and
    # the hostile ones on their own threads, arriving while those are queued or running.
    with ThreadPoolExecutor(max_workers=clients) as pool, ThreadPoolExecutor(max_workers=len(bad)) as side:
        futures = [pool.submit(one, i) for i in range(requests)]
        futures += [side.submit(hostile, name, raw) for name, raw in bad.items()]
        for f in futures:
            f.result(timeout=max(1.0, deadline - time.monotonic()))
    stop.set()
    poller.join(10)
    shared.close()
    health.close()
    report.seconds = time.monotonic() - start
    ordered = sorted(latencies)
    report.health_checks = len(ordered)
    if ordered:
        report.health_worst_ms = 1000 * ordered[-1]
        report.health_p99_ms = 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return report


def report_json(report: LoadReport) -> str:
    return json.dumps(asdict(report), indent=1)
