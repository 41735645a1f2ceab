"""Prometheus metrics for one server (its own CollectorRegistry), named like vLLM's with the `specdec:` prefix.

prometheus_client appends `_total` to counters on exposition, exactly as vLLM's do:
`specdec:spec_decode_num_drafts` is scraped as `specdec:spec_decode_num_drafts_total`.
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from specdec.core.stats import SpecStats

# vLLM's buckets, so dashboards built for vLLM read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
PASS_ROWS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """Counters, gauges and histograms for one served model; safe to update from the engine thread."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        # No `*_created` series next to every counter (process-wide setting; vLLM turns them off too).
        disable_created_metrics()
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def counter(name, doc, extra=()):
            metric = Counter(name, doc, m + list(extra), registry=r)
            if not extra:
                metric.labels(model_name)  # exposed as 0 from the start
            return metric

        self._num_drafts = counter("specdec:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self._num_draft_tokens = counter("specdec:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self._num_accepted_tokens = counter("specdec:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._accepted_per_pos = counter(
            "specdec:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", ["position"]
        )
        self._prompt_tokens = counter("specdec:prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = counter("specdec:generation_tokens", "Number of generation tokens processed.")
        # vLLM's prefix cache counters, in tokens: hits / queries is the share of prompt tokens not prefilled.
        self._prefix_cache_queries = counter(
            "specdec:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self._prefix_cache_hits = counter(
            "specdec:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self._request_success = counter(
            "specdec:request_success", "Count of finished requests by finish reason (stop, length, abort, error).",
            ["finished_reason"],
        )
        self._request_errors = counter(
            "specdec:request_errors", "Requests refused with an HTTP error, by status code.", ["status"]
        )
        self._running = Gauge("specdec:num_requests_running", "Requests being generated (at most --parallel).", m, registry=r)
        self._waiting = Gauge("specdec:num_requests_waiting", "Requests waiting in the FIFO queue.", m, registry=r)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self.time_to_first_token = histogram(
            "specdec:time_to_first_token_seconds", "Time from request arrival to its first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "specdec:inter_token_latency_seconds",
            "Time between successive engine steps of a request (one step may emit several tokens).", ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "specdec:e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS
        )
        self.pass_rows = histogram(
            "specdec:target_pass_rows", "Rows in one target pass (every running sequence's last token, drafts and "
            "prefill chunk).", PASS_ROWS_BUCKETS,
        )
        self.request_queue_time = histogram(
            "specdec:request_queue_time_seconds", "Time a request waited in the queue.", REQUEST_BUCKETS
        )
        self._lock = threading.Lock()
        for reason in ("stop", "length", "abort", "error"):
            self._request_success.labels(model_name, reason)
        self.running = self._running.labels(model_name)
        self.waiting = self._waiting.labels(model_name)

    def declare_positions(self, k: int) -> None:
        """Expose every draft position from the start (0 until accepted), as vLLM does."""
        for i in range(k):
            self._accepted_per_pos.labels(self.model_name, str(i))

    def add_stats_delta(self, now: SpecStats, before: dict) -> None:
        """Count what `now` added since the snapshot `before` (updated in place): live counters per step."""
        with self._lock:
            for name, metric in (
                ("num_drafts", self._num_drafts),
                ("num_draft_tokens", self._num_draft_tokens),
                ("num_accepted_tokens", self._num_accepted_tokens),
                ("num_prompt_tokens", self._prefix_cache_queries),
                ("num_cached_prompt_tokens", self._prefix_cache_hits),
            ):
                value = getattr(now, name)
                if value > before.get(name, 0):
                    metric.labels(self.model_name).inc(value - before.get(name, 0))
                before[name] = value
            per_pos = before.setdefault("per_pos", [])
            for i, value in enumerate(now.num_accepted_tokens_per_pos):
                seen = per_pos[i] if i < len(per_pos) else 0
                if value > seen:
                    self._accepted_per_pos.labels(self.model_name, str(i)).inc(value - seen)
            before["per_pos"] = list(now.num_accepted_tokens_per_pos)

    def prompt_tokens(self, n: int) -> None:
        self._prompt_tokens.labels(self.model_name).inc(n)

    def generation_tokens(self, n: int) -> None:
        self._generation_tokens.labels(self.model_name).inc(n)

    def request_finished(self, reason: str) -> None:
        self._request_success.labels(self.model_name, reason).inc()

    def request_error(self, status: int) -> None:
        self._request_errors.labels(self.model_name, str(status)).inc()

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
