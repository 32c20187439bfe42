"""kv-metadata: which worker holds which KV block, for the whole cluster.

Fed by the workers' KV event batches (applied in order per worker; a gap or a first sight
mid-stream triggers a snapshot resync), mirrored in etcd under each owner's lease (batched),
rebuilt from etcd when it restarts, and asked over NATS: "for this chain of block hashes,
how many leading blocks does each worker hold?".

Metrics (``kvmesh.metrics.kvindex``) at ``/metrics`` on the health port. Traces: a
``kv_query`` span per query, a child of the router's request span; ingestion, which never
stops, is summed up in one ``kv_ingest`` span per ``INGEST_SPAN_INTERVAL`` in which batches
came (never one per batch), and a ``kv_resync`` span per snapshot resync.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections import deque

import nats
from nats.aio.msg import Msg
from pydantic import ValidationError

from kvmesh.cluster.connect import connect_mesh
from kvmesh.cluster.directory import WorkerDirectory
from kvmesh.cluster.etcd_store import EtcdStore
from kvmesh.cluster.registration import LeasedKey
from kvmesh.hashing import hash_from_hex
from kvmesh.kvindex.replica import IndexReplica, ReplicaListener, pool_capacity
from kvmesh.metrics.kvindex import KVIndexMetrics
from kvmesh.protocol import (
    KVEventBatch,
    KVIndexStats,
    KVQuery,
    KVQueryReply,
    KVSnapshot,
    Keys,
    Subjects,
    WorkerRecord,
)
from kvmesh.services.kv_metadata.mirror import EtcdMirror
from kvmesh.service_main import start_service, until_signalled
from kvmesh.settings.kv_metadata import INGEST_SPAN_INTERVAL, kv_metadata_settings
from kvmesh.settings.mesh import MeshSettings
from kvmesh.telemetry import extract_context, shutdown_tracing, tracer
from kvmesh.worker.health import HealthServer, HealthStatus

logger = logging.getLogger(__name__)


class IngestWindow:
    """What the event batches of one interval did, for one ``kv_ingest`` span."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start_ns = time.time_ns()
        self.batches = 0
        self.events = 0
        self.stored = 0
        self.removed = 0
        self.workers: set[str] = set()

    def add(self, batch: KVEventBatch) -> None:
        self.batches += 1
        self.events += len(batch.events)
        self.workers.add(batch.worker_id)
        for event in batch.events:
            if event.kind == "stored":
                self.stored += len(event.block_hashes)
            elif event.kind == "removed":
                self.removed += len(event.block_hashes)

    def emit(self, tracer_) -> None:
        """The interval's span (none for an interval without batches); a new interval begins."""
        if self.batches:
            span = tracer_.start_span("kv_ingest", start_time=self.start_ns)
            span.set_attribute("kvmesh.batches", self.batches)
            span.set_attribute("kvmesh.events", self.events)
            span.set_attribute("kvmesh.blocks_stored", self.stored)
            span.set_attribute("kvmesh.blocks_removed", self.removed)
            span.set_attribute("kvmesh.workers", len(self.workers))
            span.end()
        self.reset()


class _Bookkeeping(ReplicaListener):
    """What kv-metadata does beside the index: the etcd mirror, the metrics, the ingest spans."""

    def __init__(self, service: KVMetadataService) -> None:
        self.service = service
        self.blocks_ingested = 0

    def batch(self, batch: KVEventBatch) -> None:
        self.service.metrics.events.inc(len(batch.events))
        self.service.ingest.add(batch)

    def stored(self, worker_id: str, hashes: list[str], tier: str, added: int) -> None:
        self.blocks_ingested += added
        self.service.mirror.stored(worker_id, hashes, tier)

    def removed(self, worker_id: str, hashes: list[str]) -> None:
        self.service.mirror.removed(worker_id, hashes)

    def replaced(self, worker_id: str, hashes: list[str], tier: str) -> None:
        self.service.mirror.replace(worker_id, hashes, tier)

    def gap(self, worker_id: str) -> None:
        self.service.metrics.gaps.inc()

    def resynced(self, worker_id: str, blocks: int) -> None:
        self.service.metrics.resyncs.inc()


class KVMetadataService:
    def __init__(
        self,
        mesh: MeshSettings,
        *,
        service_id: str | None = None,
        mirror_interval: float = 0.2,
        ingest_span_interval: float = INGEST_SPAN_INTERVAL,
    ) -> None:
        self.mesh = mesh
        self.ingest_span_interval = ingest_span_interval
        self.service_id = service_id or f"kv-metadata-{uuid.uuid4().hex[:8]}"
        self.subjects = Subjects(mesh.namespace)
        self.keys = Keys(mesh.namespace)
        self.mirror_interval = mirror_interval
        self.nc: nats.NATS
        self.store: EtcdStore
        self.directory: WorkerDirectory
        self.mirror: EtcdMirror
        self.registration: LeasedKey | None = None
        self._tasks: set[asyncio.Task] = set()
        self._query_ms: deque[float] = deque(maxlen=10_000)
        self.queries = 0
        self._started = time.monotonic()
        self.metrics = KVIndexMetrics(lambda: self.index.num_blocks, lambda: len(self.index.workers()))
        self.tracer = tracer("kvmesh.kv_metadata")
        self.ingest = IngestWindow()
        self.replica_bookkeeping = _Bookkeeping(self)
        # events arrive once ``start`` has the directory (the etcd rebuild before it is not bounded)
        capacity = lambda worker_id: pool_capacity(self.directory.workers.get(worker_id))  # noqa: E731
        self.replica = IndexReplica(self.subjects, self._fetch_snapshot, listener=self.replica_bookkeeping, capacity=capacity)
        self.index = self.replica.index

    @property
    def resyncs(self) -> int:
        return self.replica.resyncs

    async def start(self) -> None:
        self.nc, self.store = await connect_mesh(self.mesh, self.service_id)
        self.directory = WorkerDirectory(self.store, self.keys)
        self.directory.on_change(self._worker_changed)
        await self.directory.start()
        self.mirror = EtcdMirror(self.store, self.keys, self.directory.leases.get)
        await self._rebuild_from_etcd()
        await self.nc.subscribe(self.subjects.kv_events, cb=self._handle_batch)
        await self.nc.subscribe(self.subjects.kv_query, cb=self._handle_query)
        await self.nc.subscribe(self.subjects.kv_stats, cb=self._handle_stats)
        self._spawn(self.mirror.run(self.mirror_interval), "kv-mirror")
        self._spawn(self._ingest_spans(), "kv-ingest-spans")
        record = WorkerRecord(
            worker_id=self.service_id,
            role="kv-metadata",
            model="",
            max_model_len=0,
            subject=self.subjects.kv_query,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=time.time(),
        )
        self.registration = LeasedKey(self.store, self.keys.worker("kv-metadata", self.service_id), record.encode(), ttl=5)
        await self.registration.start()
        logger.info("kv-metadata %s ready: %d blocks of %d workers", self.service_id, self.index.num_blocks, len(self.index.workers()))

    def health_status(self) -> HealthStatus:
        nc = getattr(self, "nc", None)
        checks = {
            "nats": nc is not None and nc.is_connected,
            "etcd": self.registration is not None and self.registration.confirmed,
        }
        failing = ", ".join(f"{k} failing" for k, ok in checks.items() if not ok)
        return HealthStatus(live=True, ready=all(checks.values()), checks=checks, detail=failing)

    def _spawn(self, coroutine, name: str) -> None:
        task = asyncio.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)  # finished resyncs do not pile up

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.replica.close()
        self.ingest.emit(self.tracer)
        await self.mirror.flush()
        if self.registration is not None:
            await self.registration.stop()
        await self.directory.stop()
        await self.nc.drain()
        await self.store.close()

    # -- state ---------------------------------------------------------------------------
    async def _rebuild_from_etcd(self) -> None:
        owned = await self.mirror.load()
        for worker_id, blocks in owned.items():
            for tier in set(blocks.values()):
                self.index.stored(worker_id, [h for h, t in blocks.items() if t == tier], tier)
        if owned:
            logger.info("rebuilt %d blocks of %d workers from etcd", self.index.num_blocks, len(owned))

    def _worker_changed(self, worker_id: str, record: WorkerRecord | None) -> None:
        if record is not None:
            if record.role in ("prefill", "decode"):  # its batches count again; a gap resyncs it
                self.replica.joined(worker_id, snapshot=False)
            return
        dropped = self.replica.left(worker_id)
        self.mirror.forget(worker_id)
        if dropped:
            logger.info("worker %s left: %d blocks out of the index", worker_id, dropped)

    async def _ingest_spans(self) -> None:
        while True:
            await asyncio.sleep(self.ingest_span_interval)
            self.ingest.emit(self.tracer)

    # -- events --------------------------------------------------------------------------
    async def _handle_batch(self, msg: Msg) -> None:
        self.replica.receive(msg.subject, msg.data)

    async def _fetch_snapshot(self, worker_id: str) -> KVSnapshot:
        """A worker's blocks, for the replica's resync after a gap: one ``kv_resync`` span."""
        with self.tracer.start_as_current_span("kv_resync") as span:
            span.set_attribute("kvmesh.worker_id", worker_id)
            reply = await self.nc.request(self.subjects.kv_snapshot(worker_id), b"", timeout=self.mesh.request_timeout)
            snapshot = KVSnapshot.decode(reply.data)
            span.set_attribute("kvmesh.blocks", len(snapshot.block_hashes))
            return snapshot

    # -- queries -------------------------------------------------------------------------
    async def _handle_query(self, msg: Msg) -> None:
        started = time.perf_counter()
        with self.tracer.start_as_current_span("kv_query", context=extract_context(msg.headers)) as span:
            try:
                chain = [hash_from_hex(h) for h in KVQuery.decode(msg.data).block_hashes]
            except (ValidationError, ValueError):
                span.set_attribute("kvmesh.malformed", True)
                await msg.respond(KVQueryReply(matches={}).encode())
                return
            matches = self.index.prefix_match(chain)
            await msg.respond(KVQueryReply(matches=matches).encode())  # the router waits; the bookkeeping does not
            seconds = time.perf_counter() - started
            self._query_ms.append(seconds * 1e3)
            self.metrics.query_seconds.observe(seconds)
            self.queries += 1
            span.set_attribute("kvmesh.chain_blocks", len(chain))
            span.set_attribute("kvmesh.workers_matched", len(matches))
            span.set_attribute("kvmesh.best_match_blocks", max(matches.values(), default=0))

    def stats(self) -> KVIndexStats:
        latencies = sorted(self._query_ms)

        def pct(q: float) -> float:
            return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else 0.0

        return KVIndexStats(
            num_blocks=self.index.num_blocks,
            num_entries=self.index.num_entries,
            workers={w: self.index.blocks_of(w) for w in self.index.workers()},
            events_per_second=self.replica_bookkeeping.blocks_ingested / max(1e-9, time.monotonic() - self._started),
            blocks_ingested=self.replica_bookkeeping.blocks_ingested,
            queries=self.queries,
            query_p50_ms=pct(0.5),
            query_p99_ms=pct(0.99),
            resyncs=self.resyncs,
        )

    async def _handle_stats(self, msg: Msg) -> None:
        await msg.respond(self.stats().encode())


async def main(argv: list[str] | None = None) -> None:
    settings = kv_metadata_settings(argv)
    await start_service("kv-metadata", settings, instance="service_id")
    service = KVMetadataService(
        settings.mesh,
        service_id=settings.service_id,
        mirror_interval=settings.mirror_interval,
        ingest_span_interval=settings.ingest_span_interval,
    )
    health = HealthServer(service.health_status, settings.health_host, settings.health_port, metrics=service.metrics.render)
    await health.start()
    await service.start()
    await until_signalled()
    await service.close()
    await health.stop()
    shutdown_tracing()
