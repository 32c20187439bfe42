"""kv-metadata's Prometheus metrics (``kvmesh.metrics.contract.KV_METADATA``), served at
``/metrics`` on its health port. Its index spans every model: ``model_name`` is ``all``."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvmesh.metrics import buckets
from kvmesh.metrics.contract import ALL_MODELS


class KVIndexMetrics:
    def __init__(self, num_blocks: Callable[[], int], num_workers: Callable[[], int]) -> None:
        self.registry = r = CollectorRegistry()
        labels = {"model_name": ALL_MODELS}
        names = list(labels)
        blocks = Gauge("kvmesh:kvindex_blocks", "Distinct KV blocks in the index", names, registry=r).labels(**labels)
        blocks.set_function(lambda: float(num_blocks()))
        workers = Gauge("kvmesh:kvindex_workers", "Workers with blocks in the index", names, registry=r).labels(**labels)
        workers.set_function(lambda: float(num_workers()))
        self.events = Counter(
            "kvmesh:kvindex_events", "KV events applied (stored, removed, cleared)", names, registry=r
        ).labels(**labels)
        self.gaps = Counter(
            "kvmesh:kvindex_event_gaps", "Gaps seen in a worker's event sequence (each starts a resync)", names, registry=r
        ).labels(**labels)
        self.resyncs = Counter(
            "kvmesh:kvindex_resyncs", "Workers' blocks replaced by a snapshot after a gap", names, registry=r
        ).labels(**labels)
        self.query_seconds = Histogram(
            "kvmesh:kvindex_query_seconds", "One prefix query, decode to answer", names, buckets=buckets.INDEX_QUERY, registry=r
        ).labels(**labels)

    async def render(self) -> bytes:
        return generate_latest(self.registry)
