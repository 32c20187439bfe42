"""A worker's KV event publisher: a snapshot is taken of the engine once per published batch,
whatever the number of requests for it (a fake engine and NATS connection; the burst through
the mesh's own credentials is in ``tests/mesh/test_trust.py``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

from kvmesh.protocol import KVEventBatch, KVSnapshot, Subjects
from kvmesh.worker.engine_api import BlockStored
from kvmesh.worker.kv_events import KVEventPublisher
from tests.cancellation import sleep_swallowing_cancellation


@dataclass
class FakeEngine:
    blocks: list[int] = field(default_factory=lambda: [11, 12])
    pending: list = field(default_factory=list)
    snapshots_taken: int = 0
    kv_layout = SimpleNamespace(block_size=16)

    async def take_kv_events(self) -> list:
        events, self.pending = self.pending, []
        return events

    async def kv_snapshot(self):
        self.snapshots_taken += 1
        await asyncio.sleep(0)  # the engine thread's hop: other requests arrive meanwhile
        events, self.pending = self.pending, []
        return events, list(self.blocks)


class FakeNats:
    def __init__(self) -> None:
        self.published: list[KVEventBatch] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append(KVEventBatch.decode(data))


class FakeMsg:
    def __init__(self) -> None:
        self.reply: bytes | None = None

    async def respond(self, data: bytes) -> None:
        self.reply = data


async def ask(publisher: KVEventPublisher, count: int) -> list[KVSnapshot]:
    msgs = [FakeMsg() for _ in range(count)]
    await asyncio.gather(*(publisher._handle_snapshot(msg) for msg in msgs))  # type: ignore[arg-type]
    return [KVSnapshot.decode(msg.reply) for msg in msgs if msg.reply is not None]


def stored(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, block_ids=tuple(range(len(hashes))), block_size=16)


async def test_requests_between_two_batches_share_one_snapshot_of_the_engine():
    engine, nc, answers = FakeEngine(), FakeNats(), []
    publisher = KVEventPublisher(engine, nc, Subjects("default"), "prefill-1", on_snapshot=answers.append)  # type: ignore[arg-type]
    first = await ask(publisher, 50)
    assert len(first) == 50 and {s.seq for s in first} == {-1} and {tuple(s.block_hashes) for s in first} == {(f"{11:032x}", f"{12:032x}")}
    assert engine.snapshots_taken == 1 and answers.count(True) == 1 and answers.count(False) == 49
    # a batch published: the state it describes moved on, so the next request asks the engine
    engine.pending, engine.blocks = [stored(13)], [11, 12, 13]
    await publisher.flush()
    assert [b.seq for b in nc.published] == [0]
    second = await ask(publisher, 3)
    assert engine.snapshots_taken == 2 and {s.seq for s in second} == {0} and len(second[0].block_hashes) == 3


async def test_events_pending_at_a_snapshot_go_out_first_as_the_batch_it_is_as_of():
    engine, nc = FakeEngine(), FakeNats()
    publisher = KVEventPublisher(engine, nc, Subjects("default"), "prefill-1")  # type: ignore[arg-type]
    await ask(publisher, 1)
    engine.pending, engine.blocks = [stored(13)], [11, 12, 13]  # not yet published when asked
    # the kept snapshot is as of batch -1, still true: the pending events will be batch 0
    kept = await ask(publisher, 1)
    assert engine.snapshots_taken == 1 and kept[0].seq == -1 and nc.published == []
    await publisher.flush()
    fresh = await ask(publisher, 1)
    assert engine.snapshots_taken == 2 and fresh[0].seq == 0 and len(fresh[0].block_hashes) == 3
    # taken with events pending: they are published as the batch the snapshot is as of
    engine.pending = [stored(14)]
    await publisher.flush()  # batch 1: the kept snapshot (as of 0) is out of date
    engine.pending, engine.blocks = [stored(15)], [11, 12, 13, 14, 15]
    taken = await ask(publisher, 1)
    assert engine.snapshots_taken == 3 and [b.seq for b in nc.published] == [0, 1, 2]
    assert taken[0].seq == 2 and len(taken[0].block_hashes) == 5


class SwallowingNats(FakeNats):
    """A publish that swallows a cancellation, as nats-py's forced flush of a full buffer does."""

    def __init__(self) -> None:
        super().__init__()
        self.publishing = asyncio.Event()

    async def subscribe(self, subject: str, cb) -> None:  # noqa: ANN001 - the fake's signature
        pass

    async def publish(self, subject: str, data: bytes) -> None:
        self.publishing.set()
        await sleep_swallowing_cancellation(0.3)
        await super().publish(subject, data)


async def test_the_publisher_stops_even_when_a_publish_swallowed_the_stop():
    """Stopped while a batch is going out through a publish that swallows the cancellation, the
    publishing loop ends anyway (it went on publishing every 0.1 s after the worker's stop)."""
    engine, nc = FakeEngine(), SwallowingNats()
    publisher = KVEventPublisher(engine, nc, Subjects("default"), "prefill-1", interval=0.01)  # type: ignore[arg-type]
    await publisher.start()
    engine.pending = [stored(21)]
    await nc.publishing.wait()
    task = publisher._task
    assert task is not None
    await publisher.stop()
    done, _ = await asyncio.wait([task], timeout=2)
    assert done and task.cancelled()
