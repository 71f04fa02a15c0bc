"""Prometheus metrics under vLLM's names and meanings (so a vLLM dashboard works), plus paperback's own.

vLLM's series carry a `model_name` label: requests running and waiting, KV
cache usage (0 to 1), prefix-cache queries and hits (tokens), prompt and
generation tokens, preemptions, finished requests by reason, and histograms
of time to first token, inter-token latency, end-to-end latency and queue
time, and sequences swapped to host memory. paperback adds its block counts and refused requests.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Engine counters (paperback.engine.llm.LLMEngine.stats) -> vLLM counter.
_COUNTERS = {"prefix_query_tokens": "prefix_cache_queries", "prefix_hit_tokens": "prefix_cache_hits",
             "prompt_tokens": "prompt_tokens", "generation_tokens": "generation_tokens",
             "preemptions": "num_preemptions"}


class ServerMetrics:
    def __init__(self, model_name: str = "model"):
        self.registry = r = CollectorRegistry()
        label = ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(name, doc, label, registry=r).labels(model_name)

        def histogram(name, doc):
            return Histogram(name, doc, label, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the engine's running batch")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for admission")
        self.swapped = gauge("vllm:num_requests_swapped", "Sequences preempted to host memory")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage: 1 means every block is held")
        docs = {"prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
                "prefix_cache_hits": "Prompt tokens found in the prefix cache",
                "prompt_tokens": "Prompt tokens processed", "generation_tokens": "Generation tokens sampled",
                "num_preemptions": "Sequences preempted (recomputed later or swapped to host memory)"}
        self.counters = {key: Counter(f"vllm:{name}", docs[name], label, registry=r).labels(model_name)
                         for key, name in _COUNTERS.items()}
        self._seen = {key: 0 for key in _COUNTERS}
        self.success = Counter("vllm:request_success", "Finished requests by finish reason",
                               ["model_name", "finished_reason"], registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between a sequence's successive tokens")
        self.tpot = histogram("vllm:request_time_per_output_token_seconds", "Decode time per token after the first")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to the last token")
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled")
        # paperback's own
        self.blocks_used = Gauge("paperback_kv_blocks_used", "KV cache blocks held by sequences", registry=r)
        self.blocks_free = Gauge("paperback_kv_blocks_free", "KV cache blocks free (cached ones included)",
                                 registry=r)
        self.rejected = Counter("paperback_requests_rejected", "Requests refused (overload or bad input)",
                                ["reason"], registry=r)

    def update(self, stats: dict) -> None:
        """Gauges to the engine's state; counters forward by what the engine counted since the last update."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.swapped.set(stats["swapped"])
        self.kv_usage.set(stats["kv_cache_usage"])
        self.blocks_used.set(stats["blocks_used"])
        self.blocks_free.set(stats["blocks_free"])
        for key, counter in self.counters.items():
            if stats[key] > self._seen[key]:
                counter.inc(stats[key] - self._seen[key])
                self._seen[key] = stats[key]

    def observe_finished(self, output) -> None:
        reasons = {c.finish_reason or "abort" for c in output.outputs}
        for reason in reasons:
            self.success.labels(self.model_name, reason).inc()
        timings = output.timings
        if timings.get("queue_s") is not None:
            self.queue.observe(timings["queue_s"])
        if timings.get("total_s") is not None:
            self.e2e.observe(timings["total_s"])
        ttft = timings.get("time_to_first_token_s")
        if ttft is not None:
            self.ttft.observe(ttft)
        for times in timings.get("token_times", []):
            for earlier, later in zip(times, times[1:]):
                self.itl.observe(later - earlier)
            if len(times) > 1:
                self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
