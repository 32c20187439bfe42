"""The metric names every service exports: the one list that docs/metrics.md describes, the
dashboards and alerts query, and tests/mesh/test_metrics.py checks against a live mesh.

Each entry is (name, kind, labels besides ``model_name``). Counters are named without
``_total``; prometheus_client exports ``<name>_total``. Worker series also carry ``role``
(prefill|decode) and ``worker`` (the worker id)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class MetricName:
    name: str
    kind: Kind
    labels: tuple[str, ...] = ()

    def exported(self) -> str:
        """The name a scrape shows for it (a histogram's ``_bucket`` / ``_sum`` / ``_count``
        series are found by their family's name)."""
        return f"{self.name}_total" if self.kind == "counter" else self.name


WORKER_LABELS = ("model_name", "role", "worker")

WORKER: tuple[MetricName, ...] = (
    MetricName("kvmesh:kv_cache_usage_perc", "gauge"),
    MetricName("kvmesh:kv_blocks", "gauge", ("state", "tier")),
    MetricName("kvmesh:num_requests_running", "gauge"),
    MetricName("kvmesh:num_requests_waiting", "gauge"),
    MetricName("kvmesh:kv_blocks_reserved_for_growth", "gauge"),
    MetricName("kvmesh:num_preemptions", "counter"),
    MetricName("kvmesh:prefix_cache_queries", "counter"),
    MetricName("kvmesh:prefix_cache_hits", "counter"),
    MetricName("kvmesh:prompt_tokens", "counter"),
    MetricName("kvmesh:generation_tokens", "counter"),
    MetricName("kvmesh:request_queue_time_seconds", "histogram"),
    MetricName("kvmesh:request_prefill_time_seconds", "histogram"),
    MetricName("kvmesh:request_decode_time_seconds", "histogram"),
    MetricName("kvmesh:time_to_first_token_seconds", "histogram"),
    MetricName("kvmesh:inter_token_latency_seconds", "histogram"),
    MetricName("kvmesh:e2e_request_latency_seconds", "histogram"),
    MetricName("kvmesh:kv_transfer_bytes", "counter", ("direction",)),
    MetricName("kvmesh:kv_transfer_seconds", "histogram", ("direction",)),
    MetricName("kvmesh:engine_step_seconds", "histogram"),
    MetricName("kvmesh:kv_snapshots", "counter", ("answered",)),
    MetricName("kvmesh:core_lending", "counter", ("event",)),
)

KV_METADATA: tuple[MetricName, ...] = (
    MetricName("kvmesh:kvindex_blocks", "gauge"),
    MetricName("kvmesh:kvindex_workers", "gauge"),
    MetricName("kvmesh:kvindex_events", "counter"),
    MetricName("kvmesh:kvindex_event_gaps", "counter"),
    MetricName("kvmesh:kvindex_resyncs", "counter"),
    MetricName("kvmesh:kvindex_query_seconds", "histogram"),
)

ROUTER: tuple[MetricName, ...] = (
    MetricName("kvmesh:router_requests", "counter", ("endpoint", "status")),
    MetricName("kvmesh:router_requests_in_flight", "gauge"),
    MetricName("kvmesh:router_routing_decisions", "counter", ("reason",)),
    MetricName("kvmesh:router_retries", "counter", ("reason",)),
    MetricName("kvmesh:router_rate_limit_rejections", "counter", ("limit",)),
    MetricName("kvmesh:router_time_to_first_token_seconds", "histogram"),
    MetricName("kvmesh:router_inter_token_latency_seconds", "histogram"),
    MetricName("kvmesh:router_e2e_request_latency_seconds", "histogram"),
    MetricName("kvmesh:router_kv_index_blocks", "gauge"),
)

BY_SERVICE: dict[str, tuple[MetricName, ...]] = {"worker": WORKER, "kv-metadata": KV_METADATA, "router": ROUTER}

# kv-metadata's index spans every model: its series say so with this model_name.
ALL_MODELS = "all"
