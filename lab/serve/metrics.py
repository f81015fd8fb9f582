"""Prometheus metrics of one server, with vLLM's names (docs/serving.md lists them).

One :class:`prometheus_client.CollectorRegistry` per server (never the global one), so two
servers in one process, or a test's, do not share counters. Every metric carries the label
``model_name`` as vLLM's do. Times are seconds on the server's clock: wall seconds for the
engine, simulated seconds for the digital twin (wall seconds x ``--speed``). The loop thread
updates them; prometheus-client is thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServeMetrics:
    """The server's metrics, labelled with its model name.

    Attributes (prometheus-client children; counters are exposed with ``_total``):
        running, waiting, swapped: requests in each queue (``vllm:num_requests_*``).
        kv_usage: used GPU KV blocks / all of them, 1 = full (``vllm:kv_cache_usage_perc``).
        prefix_queries, prefix_hits: prompt tokens looked up in / found in the prefix
            cache, counted at a request's first token.
        preemptions, prompt_tokens, generation_tokens, success (by ``finished_reason``).
        ttft, itl, e2e: histograms; ``itl`` is observed once per step that gives a
            request tokens (a speculative step's several tokens count as one gap).
        spec_drafts, spec_draft_tokens, spec_accepted: speculative decoding counters (only
            with ``speculative``).
    """

    def __init__(self, model_name: str, speculative: bool = False) -> None:
        self.registry = r = CollectorRegistry()
        label = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.")
        self.swapped = gauge("vllm:num_requests_swapped", "Requests swapped out to CPU.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the cache.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (recompute or swap).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of started requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Output tokens generated.")
        self._success = Counter(
            "vllm:request_success",
            "Requests ended, by finished_reason (stop, length, abort).",
            [*label, "finished_reason"],
            registry=r,
        )
        self.model_name = model_name
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Gap between a request's token steps.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS
        )
        self.speculative = speculative
        if speculative:
            self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Decodes verifying drafts.")
            self.spec_draft_tokens = counter(
                "vllm:spec_decode_num_draft_tokens", "Draft tokens verified."
            )
            self.spec_accepted = counter(
                "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted."
            )

    def success(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def exposition(self) -> bytes:
        """The text format of ``/metrics``."""
        return generate_latest(self.registry)
