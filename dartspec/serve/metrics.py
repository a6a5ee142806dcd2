"""Prometheus metrics of a server instance (own registry: two servers in one process never mix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dartspec.engine import GenerationResult


class Metrics:
    """Requests, tokens, drafts and acceptance, exported at ``GET /metrics``."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dartspec_requests", "Finished generations", ["drafter"], registry=r)
        self.rejected = Counter("dartspec_rejected_requests", "Requests refused because the queue was full", registry=r)
        self.timeouts = Counter("dartspec_timeouts", "Generations stopped by the request timeout", registry=r)
        self.cancelled = Counter(
            "dartspec_cancelled_requests", "Generations stopped early (client gone or timeout)", registry=r
        )
        self.prompt_tokens = Counter("dartspec_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("dartspec_completion_tokens", "Generated tokens", ["drafter"], registry=r)
        self.target_forwards = Counter("dartspec_target_forwards", "Target forwards", ["drafter"], registry=r)
        self.drafted = Counter("dartspec_draft_tokens", "Draft tree nodes verified (root excluded)", registry=r)
        self.accepted = Counter("dartspec_accepted_draft_tokens", "Draft tokens accepted", registry=r)
        self.depth_offered = Counter(
            "dartspec_depth_offered", "Steps whose tree reached a depth", ["depth"], registry=r
        )
        self.depth_accepted = Counter(
            "dartspec_depth_accepted", "Steps that accepted a draft at a depth", ["depth"], registry=r
        )
        self.generation_seconds = Counter("dartspec_generation_seconds", "Time spent generating", registry=r)
        self.tokens_per_s = Gauge("dartspec_last_tokens_per_second", "Tokens/s of the last generation", registry=r)
        self.in_flight = Gauge("dartspec_in_flight", "Generations running now", registry=r)
        self.waiting = Gauge("dartspec_waiting", "Requests waiting for a place in the batch", registry=r)
        self.step_batch = Histogram(
            "dartspec_step_batch_size",
            "Requests decoded together per target forward (continuous batching)",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )

        self.kv_bytes = Gauge(
            "dartspec_kv_bytes", "KV bytes held: running requests' own positions plus the prefix cache", registry=r
        )
        self.kv_bytes_unshared = Gauge(
            "dartspec_kv_bytes_unshared", "KV bytes running requests would hold unshared", registry=r
        )
        self.prefix_hit_tokens = Gauge(
            "dartspec_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache (since start)", registry=r
        )
        self.prefix_prompt_tokens = Gauge(
            "dartspec_prefix_cache_prompt_tokens", "Prompt tokens looked up (since start)", registry=r
        )
        self.kv_read = Counter(
            "dartspec_kv_read_bytes", "KV bytes batched steps' attention read (by layout, all layers)", registry=r
        )
        self.kv_read_unshared = Counter(
            "dartspec_kv_read_bytes_unshared", "KV bytes they would read with every request reading its own", registry=r
        )
        self.prefix_bytes = Gauge("dartspec_prefix_cache_bytes", "Bytes of the prefix cache's blocks", registry=r)

    def record(self, result: GenerationResult, drafter: str) -> None:
        """Add one finished generation (``drafter``: the drafter it ran with, ``none`` for plain decoding)."""
        s = result.stats
        self.requests.labels(drafter).inc()
        self.prompt_tokens.inc(s.prompt_tokens)
        self.completion_tokens.labels(drafter).inc(s.new_tokens)
        self.target_forwards.labels(drafter).inc(s.target_forwards)
        self.drafted.inc(max(0, s.tree_nodes - max(s.target_forwards - 1, 0)))
        self.accepted.inc(s.draft_tokens_accepted)
        for d, (offered, accepted) in enumerate(zip(s.depth_offered, s.depth_accepted, strict=True), start=1):
            self.depth_offered.labels(str(d)).inc(offered)
            self.depth_accepted.labels(str(d)).inc(accepted)
        self.generation_seconds.inc(s.seconds)
        self.tokens_per_s.set(s.tokens_per_s)

    def exposition(self) -> bytes:
        """The Prometheus text format."""
        return generate_latest(self.registry)
