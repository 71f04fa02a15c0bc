"""Prometheus metrics of the server: queue depths, KV blocks, prefix-cache hits, latency histograms."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("paperback_requests_running", "Sequences running in the engine", registry=r)
        self.waiting = Gauge("paperback_requests_waiting", "Sequences waiting for admission", registry=r)
        self.blocks_used = Gauge("paperback_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.blocks_free = Gauge("paperback_kv_blocks_free", "KV cache blocks free (cached ones included)",
                                 registry=r)
        self.prefix_hit_rate = Gauge("paperback_prefix_cache_hit_rate",
                                     "Full prompt blocks found in the prefix cache / looked up", registry=r)
        self.requests = Counter("paperback_requests_finished", "Requests finished", ["finish_reason"], registry=r)
        self.rejected = Counter("paperback_requests_rejected", "Requests refused (overload or bad input)",
                                ["reason"], registry=r)
        self.ttft = Histogram("paperback_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("paperback_time_per_output_token_seconds", "Decode time per token after the first",
                              buckets=LATENCY_BUCKETS, registry=r)

    def observe_finished(self, output) -> None:
        for completion in output.outputs:
            self.requests.labels(completion.finish_reason or "abort").inc()
        ttft = output.timings.get("time_to_first_token_s")
        if ttft is None:
            return
        self.ttft.observe(ttft)
        tokens = max(len(c.token_ids) for c in output.outputs)
        if tokens > 1:
            self.tpot.observe((output.timings["total_s"] - ttft) / (tokens - 1))

    def render(self, stats: dict) -> bytes:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.blocks_used.set(stats["blocks_used"])
        self.blocks_free.set(stats["blocks_free"])
        self.prefix_hit_rate.set(stats["prefix_hit_rate"])
        return generate_latest(self.registry)
