"""Metrics of `specdec serve --replicas`: every replica's `specdec:*` series in one Prometheus exposition, each
with a `replica` label, and one aggregate view (throughput, acceptance, load) over all replicas. No Ray here:
ray_serve.py's replicas report their exposition to a collector, which keeps the latest of each (ReplicaBoard).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

STALE_SECONDS = 5.0  # a replica that has not reported for this long is gone (dead, or shut down)
RATE_WINDOW_SECONDS = 60.0


@dataclass
class ReplicaReport:
    replica: str
    info: dict
    exposition: str
    received_at: float
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))


class ReplicaBoard:
    """The latest report of each live replica (the collector deployment's state)."""

    def __init__(self, stale_seconds: float = STALE_SECONDS, clock=time.monotonic):
        self.stale_seconds = stale_seconds
        self.clock = clock
        self.reports: dict[str, ReplicaReport] = {}

    def report(self, replica: str, info: dict, exposition: str) -> None:
        now = self.clock()
        entry = self.reports.get(replica)
        if entry is None:
            entry = self.reports[replica] = ReplicaReport(replica, info, exposition, now)
        entry.info, entry.exposition, entry.received_at = info, exposition, now
        totals = totals_of(exposition)
        entry.history.append((now, totals.get("generation_tokens", 0.0)))
        while entry.history and now - entry.history[0][0] > RATE_WINDOW_SECONDS:
            entry.history.popleft()

    def forget(self, replica: str) -> None:
        self.reports.pop(replica, None)

    def live(self) -> list[ReplicaReport]:
        now = self.clock()
        for replica in [r for r, e in self.reports.items() if now - e.received_at > self.stale_seconds]:
            del self.reports[replica]
        return sorted(self.reports.values(), key=lambda e: e.replica)

    def snapshot(self) -> dict[str, Any]:
        """What the ingress needs for /metrics and /replicas: each live replica's info, exposition and rate."""
        out = []
        for entry in self.live():
            rate = None
            if len(entry.history) >= 2:
                (t0, v0), (t1, v1) = entry.history[0], entry.history[-1]
                if t1 > t0 and v1 >= v0:
                    rate = (v1 - v0) / (t1 - t0)
            out.append({"replica": entry.replica, "info": entry.info, "exposition": entry.exposition,
                        "age_seconds": round(self.clock() - entry.received_at, 3), "tokens_per_second": rate})
        return {"replicas": out}


# --------------------------------------------------------------------------------------------- exposition


def merged_exposition(replicas: Mapping[str, str], extra: Iterable[Metric] = ()) -> bytes:
    """One exposition of every replica's series, each sample labelled `replica="<id>"`, families merged by
    name (HELP and TYPE from the first replica that has the family), then `extra` families."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(replicas.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value,
                                  sample.timestamp, sample.exemplar)
    collected = list(families.values()) + list(extra)

    class _Fixed:
        def collect(self):
            return collected

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed())
    return generate_latest(registry)


TOTALS = {
    "generation_tokens": "specdec:generation_tokens_total",
    "prompt_tokens": "specdec:prompt_tokens_total",
    "num_drafts": "specdec:spec_decode_num_drafts_total",
    "num_draft_tokens": "specdec:spec_decode_num_draft_tokens_total",
    "num_accepted_tokens": "specdec:spec_decode_num_accepted_tokens_total",
    "prefix_cache_queries": "specdec:prefix_cache_queries_total",
    "prefix_cache_hits": "specdec:prefix_cache_hits_total",
    "requests_running": "specdec:num_requests_running",
    "requests_waiting": "specdec:num_requests_waiting",
}
FINISHED = "specdec:request_success_total"


def totals_of(exposition: str) -> dict[str, float]:
    """One replica's counters and gauges of interest, summed over their labels (model names)."""
    names = {sample_name: key for key, sample_name in TOTALS.items()}
    out = dict.fromkeys(TOTALS, 0.0)
    out["requests_finished"] = 0.0
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            key = names.get(sample.name)
            if key is not None:
                out[key] += sample.value
            elif sample.name == FINISHED:
                out["requests_finished"] += sample.value
    return out


def ratios(totals: Mapping[str, float]) -> dict[str, float | None]:
    """Acceptance rate (accepted / proposed draft tokens), mean acceptance length (1 + accepted / drafts, the
    bonus token included) and prefix cache hit rate, as the server reports them per request."""
    drafts, proposed, accepted = totals["num_drafts"], totals["num_draft_tokens"], totals["num_accepted_tokens"]
    queries = totals["prefix_cache_queries"]
    return {
        "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
        "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
        "prefix_cache_hit_rate": round(totals["prefix_cache_hits"] / queries, 4) if queries else None,
    }


def summary(snapshot: Mapping[str, Any], ingress: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The aggregate view (`GET /replicas`): per replica and over all of them, generated tokens, tokens/s over
    the last minute, acceptance, prefix cache hits, running and waiting requests; and the ingress's counts of
    retried and failed requests."""
    rows = []
    total = dict.fromkeys(TOTALS, 0.0)
    total["requests_finished"] = 0.0
    rate_sum, rated = 0.0, 0
    for entry in snapshot.get("replicas", []):
        totals = totals_of(entry["exposition"])
        for key, value in totals.items():
            total[key] += value
        if entry.get("tokens_per_second") is not None:
            rate_sum += entry["tokens_per_second"]
            rated += 1
        rows.append({"replica": entry["replica"], **entry.get("info", {}),
                     "tokens_per_second_1m": _round(entry.get("tokens_per_second")),
                     **{k: int(v) for k, v in totals.items()}, **ratios(totals),
                     "report_age_seconds": entry.get("age_seconds")})
    aggregate = {"replicas": len(rows), "tokens_per_second_1m": round(rate_sum, 3) if rated else None,
                 **{k: int(v) for k, v in total.items()}, **ratios(total)}
    return {"aggregate": aggregate, "replicas": rows, "ingress": dict(ingress or {})}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


__all__ = ["ReplicaBoard", "merged_exposition", "ratios", "summary", "totals_of"]
