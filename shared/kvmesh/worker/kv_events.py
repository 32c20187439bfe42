"""A worker's KV cache events on NATS: drained from the engine, published in numbered
batches, and a snapshot on request so a receiver that saw a gap can resync.

A snapshot is the worker's blocks as of its last published batch, so one taken is the answer
to every request until the next batch: a burst of requests (every router resyncing at once, or
a router's credentials asking without end) costs the engine one snapshot per published batch
at most (a batch every ``interval``), not one per request."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

import nats
from nats.aio.msg import Msg

from kvmesh.hashing import hash_to_hex
from kvmesh.protocol import KVEventBatch, KVEventSpec, KVSnapshot, Subjects
from kvmesh.worker.engine_api import AllBlocksCleared, BlockRemoved, BlockStored, Engine, KVCacheEvent
from kvmesh.tasks import pause

logger = logging.getLogger(__name__)


def event_spec(event: KVCacheEvent) -> KVEventSpec:
    if isinstance(event, BlockStored):
        parent = hash_to_hex(event.parent_block_hash) if event.parent_block_hash is not None else None
        return KVEventSpec(kind="stored", block_hashes=[hash_to_hex(h) for h in event.block_hashes], parent_block_hash=parent)
    if isinstance(event, BlockRemoved):
        return KVEventSpec(kind="removed", block_hashes=[hash_to_hex(h) for h in event.block_hashes])
    assert isinstance(event, AllBlocksCleared)
    return KVEventSpec(kind="cleared")


class KVEventPublisher:
    def __init__(
        self,
        engine: Engine,
        nc: nats.NATS,
        subjects: Subjects,
        worker_id: str,
        *,
        interval: float = 0.1,
        on_snapshot: Callable[[bool], None] = lambda taken: None,
    ) -> None:
        self.engine = engine
        self.nc = nc
        self.subjects = subjects
        self.worker_id = worker_id
        self.interval = interval
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = -1  # the last batch published
        self.block_size = engine.kv_layout.block_size
        self.on_snapshot = on_snapshot  # told of each answer: True when the engine was asked
        self._lock = asyncio.Lock()  # a snapshot and a batch never interleave
        self._task: asyncio.Task | None = None
        self._last_snapshot: tuple[int, bytes] = (-2, b"")  # (as of batch, encoded); -2: none taken yet

    async def start(self) -> None:
        await self.nc.subscribe(self.subjects.kv_snapshot(self.worker_id), cb=self._handle_snapshot)
        self._task = asyncio.create_task(self._run(), name="kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.flush()

    async def flush(self) -> None:
        async with self._lock:
            events = await self.engine.take_kv_events()
            if events:
                await self._publish(events)

    async def _run(self) -> None:
        while True:
            await pause(self.interval)
            try:
                await self.flush()
            except Exception as exc:  # noqa: BLE001 - a receiver that misses a batch resyncs
                logger.warning("publishing KV events failed: %s", exc)

    async def _publish(self, events: list[KVCacheEvent]) -> None:
        self.seq += 1
        batch = KVEventBatch(
            worker_id=self.worker_id,
            epoch=self.epoch,
            seq=self.seq,
            block_size=self.block_size,
            events=[event_spec(e) for e in events],
        )
        await self.nc.publish(self.subjects.kv_events_from(self.worker_id), batch.encode())

    async def _handle_snapshot(self, msg: Msg) -> None:
        async with self._lock:
            taken = self._last_snapshot[0] != self.seq  # a batch went out since: the blocks moved on
            if taken:
                events, hashes = await self.engine.kv_snapshot()
                if events:
                    await self._publish(events)
                snapshot = KVSnapshot(
                    worker_id=self.worker_id, epoch=self.epoch, seq=self.seq, block_hashes=[hash_to_hex(h) for h in hashes]
                )
                self._last_snapshot = (self.seq, snapshot.encode())
            encoded = self._last_snapshot[1]
        self.on_snapshot(taken)
        await msg.respond(encoded)
