"""A ``KVIndex`` kept current from the workers' KV event batches: kv-metadata's, and each
router's own copy (so a request is routed without a round trip to kv-metadata).

Each worker's batches are applied in order (``EventSequencer``); a gap, or a worker first seen
mid-stream, is resynced from a snapshot of the worker's blocks (``fetch_snapshot``), the
batches that arrive meanwhile held and replayed on top; one resync a worker at a time, and a
resync overtaken by a leave (or a leave and a rejoin) changes nothing; at most
``MAX_HELD_BATCHES`` are held (past that the worker is resynced again). A batch is taken only
from the worker's own subject, and one that does not parse (a bad hash, a negative number) is
dropped whole. ``joined`` asks a worker that was never heard from for its snapshot at once (an
idle worker sends no batch that would reveal what it holds); ``left`` drops a worker that left
the directory, and its late batches. ``capacity`` bounds what one worker can claim (its pool's
blocks, from its record): what a worker's credentials could otherwise put in every router's
memory is invented hashes without end; past its bound a worker's new blocks are left out. A
``ReplicaListener`` hears of every change (kv-metadata mirrors them in etcd and counts them).

No I/O of its own beyond ``fetch_snapshot``; the resyncs run as tasks it owns (``close``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pydantic import ValidationError

from kvmesh.hashing import BlockHash, hash_from_hex
from kvmesh.kvindex.events import EventSequencer, Gap, Verdict
from kvmesh.kvindex.index import KVIndex
from kvmesh.protocol import KVEventBatch, KVSnapshot, Subjects, WorkerRecord

logger = logging.getLogger(__name__)

# A worker that just joined is asked for its snapshot this many times (its first answer may
# be lost while it starts), this many seconds apart; after that its next batch resyncs it.
JOIN_SNAPSHOT_TRIES = 3
JOIN_SNAPSHOT_RETRY = 1.0

# A worker's batches held while its snapshot comes, at most (a batch every 0.1 s at most from a
# well-behaved worker, and a snapshot answered in milliseconds): past that they are dropped and
# the worker resynced again once the snapshot is in, so a worker that floods batches while not
# answering costs a bounded memory.
MAX_HELD_BATCHES = 64

# A worker is taken to hold at most this many times its pool's blocks (``pool_capacity``): the
# bound is against invented hashes, not a count to enforce exactly.
CAPACITY_MARGIN = 2


def pool_capacity(record: WorkerRecord | None) -> int | None:
    """The most blocks a worker is taken to hold (``IndexReplica``'s ``capacity``): its pool's
    (``kv_layout.num_blocks``) times ``CAPACITY_MARGIN``; None without a record or a layout."""
    if record is None or record.kv_layout is None:
        return None
    return CAPACITY_MARGIN * record.kv_layout.num_blocks


class ReplicaListener:
    """What an ``IndexReplica`` changed, as it changes it (each a no-op here)."""

    def batch(self, batch: KVEventBatch) -> None:
        """A batch is being applied (``stored`` / ``removed`` / ``replaced`` follow)."""

    def stored(self, worker_id: str, hashes: list[str], tier: str, added: int) -> None:
        """``hashes`` (hex) are held by ``worker_id``; ``added`` of them are new there."""

    def removed(self, worker_id: str, hashes: list[str]) -> None: ...

    def replaced(self, worker_id: str, hashes: list[str], tier: str) -> None:
        """``worker_id`` holds exactly ``hashes`` now (a snapshot, a restart, a clear)."""

    def gap(self, worker_id: str) -> None: ...

    def resynced(self, worker_id: str, blocks: int) -> None: ...


class IndexReplica:
    def __init__(
        self,
        subjects: Subjects,
        fetch_snapshot: Callable[[str], Awaitable[KVSnapshot]],
        *,
        listener: ReplicaListener | None = None,
        index: KVIndex | None = None,
        capacity: Callable[[str], int | None] = lambda worker_id: None,
    ) -> None:
        self.subjects = subjects
        self.fetch_snapshot = fetch_snapshot
        self.listener = listener or ReplicaListener()
        self.index = index if index is not None else KVIndex()
        self.capacity = capacity  # the most blocks a worker can hold (None: unbounded)
        self.overflows = 0  # stored events cut short by a worker's capacity
        self.sequencer = EventSequencer()
        # worker -> the batches held while its snapshot comes; the list is the resync's token
        self._resyncing: dict[str, list[KVEventBatch]] = {}
        self._held_overflow: set[str] = set()  # workers whose resync dropped batches: resynced again
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.resyncs = 0
        self.forged_batches = 0  # batches whose worker id was not their subject's

    async def close(self) -> None:
        """Cancel the resyncs in flight; none starts after."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- what arrives ----------------------------------------------------------------------
    def receive(self, subject: str, data: bytes) -> None:
        """A message on ``kv.events.<worker>``: decoded, checked against its subject, applied."""
        try:
            batch = KVEventBatch.decode(data)
        except ValidationError:
            logger.warning("malformed KV event batch")
            return
        sender = self.subjects.sender(subject)
        if sender != batch.worker_id:  # only a worker's own credentials may publish on its subject
            self.forged_batches += 1
            logger.warning("dropped a KV event batch for %s published on %s's subject", batch.worker_id, sender)
            return
        self._offer(batch)

    def joined(self, worker_id: str, *, snapshot: bool = True) -> None:
        """A worker is in the directory (again, perhaps the same process): its batches are
        taken again, and unless its stream is followed it is asked for its blocks
        (``snapshot``; else its next batch resyncs it)."""
        self.sequencer.rejoined(worker_id)
        if not snapshot or worker_id in self._resyncing or self.sequencer.expected(worker_id) is not None:
            return
        self._start_resync(worker_id, [], tries=JOIN_SNAPSHOT_TRIES)

    def left(self, worker_id: str) -> int:
        """The worker is gone: its blocks leave the index (how many), its late batches drop."""
        dropped = self.index.remove_worker(worker_id)
        self.sequencer.forget(worker_id)
        self._resyncing.pop(worker_id, None)
        self._held_overflow.discard(worker_id)
        return dropped

    # -- applying --------------------------------------------------------------------------
    def _offer(self, batch: KVEventBatch) -> None:
        held = self._resyncing.get(batch.worker_id)
        if held is not None:  # its snapshot is on the way
            if len(held) < MAX_HELD_BATCHES:
                held.append(batch)
            elif batch.worker_id not in self._held_overflow:
                self._held_overflow.add(batch.worker_id)
                logger.warning("%s sent over %d batches while its snapshot came: resynced again after", batch.worker_id, MAX_HELD_BATCHES)
            return
        try:
            parsed = _parse(batch)
            verdict = self.sequencer.offer(batch.worker_id, batch.epoch, batch.seq)
        except ValueError as exc:  # only its own worker could have sent it: its own entries
            logger.warning("dropped a malformed KV event batch of %s: %s", batch.worker_id, exc)
            return
        if verdict is Verdict.DROP:
            return
        if isinstance(verdict, Gap):
            self.listener.gap(batch.worker_id)
            logger.info("gap in %s's events (expected %d, got %d): resyncing", batch.worker_id, verdict.expected, verdict.got)
            self._start_resync(batch.worker_id, [batch])
            return
        if verdict is Verdict.RESET:
            self.index.remove_worker(batch.worker_id)
            self.listener.replaced(batch.worker_id, [], batch.tier)
        self._apply(batch, parsed)

    def _apply(self, batch: KVEventBatch, parsed: list[list[BlockHash]]) -> None:
        worker = batch.worker_id
        self.listener.batch(batch)
        for event, hashes in zip(batch.events, parsed, strict=True):
            if event.kind == "stored":
                hashes, hex_hashes = self._within_capacity(worker, hashes, event.block_hashes)
                added = self.index.stored(worker, hashes, batch.tier)
                self.listener.stored(worker, hex_hashes, batch.tier, added)
            elif event.kind == "removed":
                self.index.removed(worker, hashes)
                self.listener.removed(worker, event.block_hashes)
            else:
                self.index.remove_worker(worker)
                self.listener.replaced(worker, [], batch.tier)

    def _within_capacity(self, worker_id: str, hashes: list[BlockHash], hex_hashes: list[str]) -> tuple[list[BlockHash], list[str]]:
        """``hashes`` (and their hex), cut to what ``worker_id`` may still add (new ones first
        in line: those it holds already cost nothing)."""
        limit = self.capacity(worker_id)
        if limit is None:
            return hashes, hex_hashes
        room = limit - self.index.blocks_of(worker_id)
        if len(hashes) <= room:
            return hashes, hex_hashes
        held = self.index.holds(worker_id, hashes)
        kept: list[int] = []
        for i, h in enumerate(hashes):
            if h in held:
                kept.append(i)
            elif room > 0:
                kept.append(i)
                room -= 1
        if len(kept) == len(hashes):
            return hashes, hex_hashes
        self.overflows += 1
        logger.warning("%s claims more blocks than its pool holds (%d): %d left out", worker_id, limit, len(hashes) - len(kept))
        return [hashes[i] for i in kept], [hex_hashes[i] for i in kept]

    def _start_resync(self, worker_id: str, held: list[KVEventBatch], *, tries: int = 1) -> None:
        if self._closed:
            return
        self._resyncing[worker_id] = held
        self._held_overflow.discard(worker_id)
        self._spawn(self._resync(worker_id, held, tries), f"resync {worker_id}")

    async def _resync(self, worker_id: str, held: list[KVEventBatch], tries: int) -> None:
        """Replace ``worker_id``'s blocks by its snapshot, then replay what was held meanwhile
        (a batch the snapshot covers drops). Given up after ``tries`` failures (its next batch
        tries again), or as soon as ``held`` is no longer the worker's resync (it left)."""

        def current() -> bool:
            return self._resyncing.get(worker_id) is held

        snapshot: KVSnapshot | None = None
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(JOIN_SNAPSHOT_RETRY)
            if not current():
                return
            try:
                snapshot = await self.fetch_snapshot(worker_id)
                if snapshot.worker_id != worker_id:
                    raise ValueError(f"the snapshot names {snapshot.worker_id}")
                if snapshot.seq < -1:
                    raise ValueError(f"the snapshot is as of batch {snapshot.seq}")
                blocks = [hash_from_hex(h) for h in snapshot.block_hashes]
                break
            except Exception as exc:  # noqa: BLE001 - tried again (or at its next batch)
                snapshot = None
                logger.warning("snapshot of %s failed: %r", worker_id, exc)
        if not current():
            return  # it left (and perhaps came back) while its snapshot came
        del self._resyncing[worker_id]
        again = worker_id in self._held_overflow  # batches were dropped: what they said is missing
        self._held_overflow.discard(worker_id)
        if snapshot is None:
            return
        self.resyncs += 1
        self.listener.resynced(worker_id, len(blocks))
        self.index.remove_worker(worker_id)
        blocks, hex_blocks = self._within_capacity(worker_id, blocks, snapshot.block_hashes)
        self.index.stored(worker_id, blocks, snapshot.tier)
        self.listener.replaced(worker_id, hex_blocks, snapshot.tier)
        self.sequencer.resynced(worker_id, snapshot.epoch, snapshot.seq + 1)
        for batch in sorted(held, key=lambda b: b.seq):
            self._offer(batch)  # held again (and the rest after it) should one start another resync
        if again and worker_id not in self._resyncing:
            self._start_resync(worker_id, [])

    def _spawn(self, coroutine, name: str) -> None:
        task = asyncio.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _parse(batch: KVEventBatch) -> list[list[BlockHash]]:
    """Each event's hashes, parsed; ``ValueError`` for a malformed one."""
    if batch.seq < 0:
        raise ValueError(f"batch number {batch.seq}")
    return [[hash_from_hex(h) for h in event.block_hashes] for event in batch.events]


__all__ = ["IndexReplica", "ReplicaListener", "pool_capacity"]
