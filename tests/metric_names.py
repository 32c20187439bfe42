"""The metrics every kvmesh service exports: the contract the dashboards, the alert rules and
the autoscaler are written against (the list of docs/metrics.md). Names are as registered
(counters without ``_total``); :func:`series_names` gives what Prometheus stores for each.

One module, so that a test of a live mesh's ``/metrics`` and the deployment tests check the
same list."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.metrics.contract import BY_SERVICE

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


# The contract itself lives in the services' code (kvmesh.metrics.contract, which docs/metrics.md
# describes and tests/mesh/test_metrics.py checks against a live mesh): one list, read here.
METRICS: tuple[Metric, ...] = tuple(
    Metric(entry.name, entry.kind, entry.labels, service) for service, entries in BY_SERVICE.items() for entry in entries
)

SUFFIXES = {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def series_names() -> dict[str, Metric]:
    """Every series name Prometheus stores for the contract's metrics, and its metric:
    ``kvmesh:prompt_tokens_total``, ``kvmesh:engine_step_seconds_bucket``, ..."""
    return {metric.name + suffix: metric for metric in METRICS for suffix in SUFFIXES[metric.kind]}
