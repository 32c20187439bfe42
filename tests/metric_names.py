"""The metrics every kvmesh service exports: the contract the dashboards, the alert rules and
the autoscaler are written against (the list of docs/metrics.md). Names are as registered
(counters without ``_total``); :func:`series_names` gives what Prometheus stores for each.

One module, so that a test of a live mesh's ``/metrics`` and the deployment tests check the
same list."""

from __future__ import annotations

from dataclasses import dataclass

WORKER_LABELS = ("model_name", "role", "worker")
SERVICE_LABELS = ("model_name",)
# Labels Prometheus adds to every scraped series (the scrape job and the target).
TARGET_LABELS = ("job", "instance")


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    kind: str  # gauge, counter or histogram
    labels: tuple[str, ...] = ()  # beyond the service's own (WORKER_LABELS or SERVICE_LABELS)
    service: str = "worker"  # worker (prefill and decode), kv-metadata or router

    @property
    def all_labels(self) -> frozenset[str]:
        own = WORKER_LABELS if self.service == "worker" else SERVICE_LABELS
        return frozenset(own + self.labels + TARGET_LABELS + (("le",) if self.kind == "histogram" else ()))


def _worker(name: str, kind: str, *labels: str) -> Metric:
    return Metric(name, kind, labels, "worker")


def _kv_metadata(name: str, kind: str, *labels: str) -> Metric:
    return Metric(name, kind, labels, "kv-metadata")


def _router(name: str, kind: str, *labels: str) -> Metric:
    return Metric(name, kind, labels, "router")


METRICS: tuple[Metric, ...] = (
    _worker("kvmesh:kv_cache_usage_perc", "gauge"),
    _worker("kvmesh:kv_blocks", "gauge", "state", "tier"),
    _worker("kvmesh:num_requests_running", "gauge"),
    _worker("kvmesh:num_requests_waiting", "gauge"),
    _worker("kvmesh:num_preemptions", "counter"),
    _worker("kvmesh:prefix_cache_queries", "counter"),
    _worker("kvmesh:prefix_cache_hits", "counter"),
    _worker("kvmesh:prompt_tokens", "counter"),
    _worker("kvmesh:generation_tokens", "counter"),
    _worker("kvmesh:request_queue_time_seconds", "histogram"),
    _worker("kvmesh:request_prefill_time_seconds", "histogram"),
    _worker("kvmesh:request_decode_time_seconds", "histogram"),
    _worker("kvmesh:time_to_first_token_seconds", "histogram"),
    _worker("kvmesh:inter_token_latency_seconds", "histogram"),
    _worker("kvmesh:e2e_request_latency_seconds", "histogram"),
    _worker("kvmesh:kv_transfer_bytes", "counter", "direction"),
    _worker("kvmesh:kv_transfer_seconds", "histogram", "direction"),
    _worker("kvmesh:engine_step_seconds", "histogram"),
    _kv_metadata("kvmesh:kvindex_blocks", "gauge"),
    _kv_metadata("kvmesh:kvindex_workers", "gauge"),
    _kv_metadata("kvmesh:kvindex_events", "counter"),
    _kv_metadata("kvmesh:kvindex_event_gaps", "counter"),
    _kv_metadata("kvmesh:kvindex_resyncs", "counter"),
    _kv_metadata("kvmesh:kvindex_query_seconds", "histogram"),
    _router("kvmesh:router_requests", "counter", "endpoint", "status"),
    _router("kvmesh:router_requests_in_flight", "gauge"),
    _router("kvmesh:router_routing_decisions", "counter", "reason"),
    _router("kvmesh:router_retries", "counter", "reason"),
    _router("kvmesh:router_rate_limit_rejections", "counter", "limit"),
    _router("kvmesh:router_time_to_first_token_seconds", "histogram"),
    _router("kvmesh:router_inter_token_latency_seconds", "histogram"),
    _router("kvmesh:router_e2e_request_latency_seconds", "histogram"),
)

SUFFIXES = {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def series_names() -> dict[str, Metric]:
    """Every series name Prometheus stores for the contract's metrics, and its metric:
    ``kvmesh:prompt_tokens_total``, ``kvmesh:engine_step_seconds_bucket``, ..."""
    return {metric.name + suffix: metric for metric in METRICS for suffix in SUFFIXES[metric.kind]}
