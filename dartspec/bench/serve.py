"""``dartspec bench serve``: what many users at once get from a server, through the official openai client.

For each concurrency level c, every prompt is sent once (chat, greedy, streamed) by c clients at a time, each
client taking the next prompt when its answer is done. Per level it reports the aggregate completion tokens per
second (all tokens over the level's wall time) and its ratio to one client at a time (measured in the same run),
the time to the first token and the time per later token of each request (p50 / p95), the mean number of
requests the server decoded together per target forward, the peak KV memory with and without the prefix cache's
sharing and the share of prompt tokens it supplied (from the server's ``/metrics``, sampled while the level runs),
and how many answers differ from the same prompt's answer at concurrency 1 (greedy output must not depend on what
else the server does). ``system`` gives every request the same system message (``--shared-prefix N``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Level:
    """One concurrency level's figures."""

    concurrency: int
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    vs_one: float = 0.0  # aggregate tokens/s over that of concurrency 1
    ttft_ms: tuple[float, float] = (0.0, 0.0)  # p50, p95
    per_token_ms: tuple[float, float] = (0.0, 0.0)  # p50, p95 of (end - first token) / (tokens - 1)
    mean_batch: float = 0.0
    mismatches: int = 0
    kv_mb: float = 0.0  # peak KV memory held (own positions + prefix cache)
    kv_unshared_mb: float = 0.0  # peak of what the same requests would hold unshared
    prefix_hit: float = 0.0  # share of the level's prompt tokens taken from the prefix cache
    kv_read_mb: float = 0.0  # KV read per batched step by attention (layout), mean over the level's steps
    kv_read_unshared_mb: float = 0.0  # the same with every request reading its own
    failures: list[str] = field(default_factory=list)


@contextmanager
def local_server(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port in a thread; yields its URL."""
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the benchmark's server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _metrics(url: str) -> dict[str, float]:
    """The server's unlabelled ``/metrics`` samples by name."""
    import httpx

    found = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            found[name] = float(value)
    return found


class _KvPeak:
    """Samples the server's KV gauges while a level runs; keeps the peaks."""

    def __init__(self, url: str, every_s: float = 0.2) -> None:
        self.url, self.every_s = url, every_s
        self.held = self.unshared = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> _KvPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            m = _metrics(self.url)
            self.held = max(self.held, m.get("dartspec_kv_bytes", 0.0))
            self.unshared = max(self.unshared, m.get("dartspec_kv_bytes_unshared", 0.0))


def shared_system_prompt(target: Any, tokens: int) -> str:
    """A system message of about ``tokens`` tokens (numbered house rules, cut to length), the same for every
    request: what a deployment's common instructions look like to the prefix cache."""
    rules = (
        "Answer the question that was asked, precisely and without padding.",
        "When a policy applies, name it and quote the relevant sentence.",
        "Prefer short answers; give detail when the user asks for it.",
        "Never invent facts, figures, names or sources; say when you do not know.",
        "Write code that runs as shown, with the imports it needs.",
        "Keep a friendly, professional tone with every customer.",
    )
    text, i = "You are the assistant of a software company. Follow these rules.", 0
    while len(target.encode(text)) < tokens:
        text += f" Rule {i + 1}: {rules[i % len(rules)]}"
        i += 1
    return target.decode(target.encode(text)[:tokens])


def _percentiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    return float(np.percentile(values, 50)), float(np.percentile(values, 95))


@dataclass(frozen=True)
class _Answer:
    text: str
    tokens: int
    ttft_s: float | None  # until the first chunk that carries tokens
    per_token_s: float | None  # (end - first token) / (tokens - 1)


def _ask(client: Any, model: str, prompt: str, max_tokens: int, system: str | None) -> _Answer:
    """One streamed greedy chat request, timed."""
    t0 = time.perf_counter()
    first = None
    parts: list[str] = []
    tokens = 0
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    for chunk in stream:
        extra = (chunk.model_extra or {}).get("dartspec") or {}
        if extra.get("tokens") and first is None:
            first = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return _Answer(
        "".join(parts),
        tokens,
        None if first is None else first - t0,
        (end - first) / (tokens - 1) if first is not None and tokens > 1 else None,
    )


def run_serve_bench(
    url: str,
    prompts: list[str],
    *,
    model: str,
    concurrency: list[int],
    max_tokens: int = 128,
    timeout_s: float = 900.0,
    system: str | None = None,
    kv_poll_s: float = 0.2,
) -> list[Level]:
    """Measure ``url`` at each concurrency level (see the module docstring); level 1 runs first (the reference).
    ``kv_poll_s``: how often the KV gauges are read while a level runs."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout_s)
    reference: list[str | None] = [None] * len(prompts)
    out = []
    for c in sorted(set(concurrency) | {1}):
        level = Level(concurrency=c, requests=len(prompts))
        before = _metrics(url)
        start = time.perf_counter()
        with _KvPeak(url, kv_poll_s) as kv, ThreadPoolExecutor(max_workers=c) as pool:
            futures = [pool.submit(_ask, client, model, p, max_tokens, system) for p in prompts]
            answers: list[_Answer | None] = []
            for i, f in enumerate(futures):
                try:
                    answers.append(f.result())
                except openai.OpenAIError as err:
                    level.failures.append(f"prompt {i}: {type(err).__name__}: {err}")
                    answers.append(None)
        level.seconds = time.perf_counter() - start
        after = _metrics(url)
        grew = {name: after[name] - before.get(name, 0.0) for name in after}
        steps = grew.get("dartspec_step_batch_size_count", 0.0)
        level.mean_batch = grew.get("dartspec_step_batch_size_sum", 0.0) / steps if steps else 0.0
        level.kv_mb, level.kv_unshared_mb = kv.held / (1 << 20), kv.unshared / (1 << 20)
        looked = grew.get("dartspec_prefix_cache_prompt_tokens", 0.0)
        level.prefix_hit = grew.get("dartspec_prefix_cache_hit_tokens", 0.0) / looked if looked else 0.0
        if steps:
            level.kv_read_mb = grew.get("dartspec_kv_read_bytes_total", 0.0) / steps / (1 << 20)
            level.kv_read_unshared_mb = grew.get("dartspec_kv_read_bytes_unshared_total", 0.0) / steps / (1 << 20)
        done = [(i, a) for i, a in enumerate(answers) if a is not None]
        level.tokens = sum(a.tokens for _, a in done)
        level.tokens_per_s = level.tokens / level.seconds if level.seconds else 0.0
        level.ttft_ms = _percentiles([1000 * a.ttft_s for _, a in done if a.ttft_s is not None])
        level.per_token_ms = _percentiles([1000 * a.per_token_s for _, a in done if a.per_token_s is not None])
        for i, a in done:
            if c == 1:
                reference[i] = a.text
            else:
                level.mismatches += a.text != reference[i]
        out.append(level)
    one_stream = out[0].tokens_per_s
    for level in out:
        level.vs_one = level.tokens_per_s / one_stream if one_stream else 0.0
    return out


def markdown(levels: list[Level], meta: dict[str, Any]) -> str:
    """The report table."""
    lines = [
        f"Server: {meta.get('runtime', '?')}, drafter {meta.get('drafter', '?')}, max batch {meta.get('max_batch')}, "
        f"{meta.get('step_rows')} rows a step; {meta.get('prompts')} prompts of {meta.get('dataset')}, greedy, "
        f"{meta.get('max_new_tokens')} new tokens at most, streamed through the openai client; shared system "
        f"prompt {meta.get('shared_prefix_tokens', 0)} tokens, prefix cache {meta.get('prefix_cache_mb', 0)} MB.",
        "",
        "| clients | aggregate tok/s | vs 1 client | TTFT p50 / p95 ms | per token p50 / p95 ms | mean batch | "
        "peak KV MB (unshared) | prompt tokens from prefix cache | KV MB read a step (unshared) | "
        "mismatches vs 1 client | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in levels:
        share = f"{lv.kv_mb / lv.kv_unshared_mb:.0%}" if lv.kv_unshared_mb else "-"
        lines.append(
            f"| {lv.concurrency} | {lv.tokens_per_s:.1f} | {lv.vs_one:.2f}x | "
            f"{lv.ttft_ms[0]:.0f} / {lv.ttft_ms[1]:.0f} | {lv.per_token_ms[0]:.1f} / {lv.per_token_ms[1]:.1f} | "
            f"{lv.mean_batch:.2f} | {lv.kv_mb:.1f} ({lv.kv_unshared_mb:.1f}; {share}) | {lv.prefix_hit:.0%} | "
            f"{lv.kv_read_mb:.1f} ({lv.kv_read_unshared_mb:.1f}) | {lv.mismatches} | {lv.seconds:.1f} |"
        )
    return "\n".join(lines)


def write_results(levels: list[Level], meta: dict[str, Any], folder: str | Path, plot: bool) -> None:
    """``serve.md``, ``serve.json`` and (``plot``) ``serve.png`` in ``folder``."""
    from dartspec.atomic import atomic_path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / "serve.md") as tmp:
        tmp.write_text(markdown(levels, meta) + "\n")
    with atomic_path(folder / "serve.json") as tmp:
        tmp.write_text(json.dumps({"meta": meta, "levels": [asdict(lv) for lv in levels]}, indent=1) + "\n")
    if not plot:
        return
    from dartspec.plotting import pyplot

    plt = pyplot("bench serve --plot")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [lv.concurrency for lv in levels]
    left.plot(xs, [lv.tokens_per_s for lv in levels], "o-")
    left.set(xscale="log", xlabel="concurrent clients", ylabel="aggregate tokens/s", title="Throughput")
    left.set_xticks(xs, [str(x) for x in xs])
    right.plot(xs, [lv.per_token_ms[0] for lv in levels], "o-", label="p50")
    right.plot(xs, [lv.per_token_ms[1] for lv in levels], "s--", label="p95")
    right.set(xscale="log", xlabel="concurrent clients", ylabel="ms per token", title="Per-token latency")
    right.set_xticks(xs, [str(x) for x in xs])
    right.legend()
    fig.tight_layout()
    with atomic_path(folder / "serve.png") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
