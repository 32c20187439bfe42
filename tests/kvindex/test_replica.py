"""``IndexReplica``: a KV index kept from event batches and snapshots, with a fake snapshot
source (the mesh tests run it against real workers, in the router and in kv-metadata)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.hashing import hash_to_hex
from kvmesh.kvindex import replica as replica_module
from kvmesh.kvindex.replica import IndexReplica, ReplicaListener
from kvmesh.protocol import KVEventBatch, KVEventSpec, KVSnapshot, Subjects

S = Subjects("default")


def hashes(*numbers: int) -> list[str]:
    return [hash_to_hex(n) for n in numbers]


def batch(worker: str, seq: int, stored: tuple[int, ...] = (), removed: tuple[int, ...] = (), *, epoch: str = "e1") -> bytes:
    events = []
    if stored:
        events.append(KVEventSpec(kind="stored", block_hashes=hashes(*stored)))
    if removed:
        events.append(KVEventSpec(kind="removed", block_hashes=hashes(*removed)))
    return KVEventBatch(worker_id=worker, epoch=epoch, seq=seq, block_size=16, events=events).encode()


class Snapshots:
    """Workers' blocks as of a batch; each fetch waits for ``gate`` when one is set."""

    def __init__(self) -> None:
        self.held: dict[str, KVSnapshot] = {}
        self.asked: list[str] = []
        self.failures = 0  # the next this many fetches fail
        self.gate: asyncio.Event | None = None

    def set(self, worker: str, seq: int, *blocks: int, epoch: str = "e1") -> None:
        self.held[worker] = KVSnapshot(worker_id=worker, epoch=epoch, seq=seq, block_hashes=hashes(*blocks))

    async def fetch(self, worker: str) -> KVSnapshot:
        self.asked.append(worker)
        if self.gate is not None:
            await self.gate.wait()
        if self.failures:
            self.failures -= 1
            raise TimeoutError("no answer")
        return self.held[worker]


def chain(*numbers: int) -> list[int]:
    return list(numbers)


async def settle(replica: IndexReplica) -> None:
    async with asyncio.timeout(5):
        for _ in range(20):
            await asyncio.sleep(0)
        while replica._tasks:
            await asyncio.sleep(0.01)


class Fetches:
    """Snapshot fetches the test answers one by one, in the order it chooses."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, asyncio.Future[KVSnapshot]]] = []

    async def fetch(self, worker: str) -> KVSnapshot:
        future: asyncio.Future[KVSnapshot] = asyncio.get_running_loop().create_future()
        self.calls.append((worker, future))
        return await future

    async def answer(self, number: int, worker: str, seq: int, *blocks: int, epoch: str = "e1") -> None:
        self.calls[number][1].set_result(KVSnapshot(worker_id=worker, epoch=epoch, seq=seq, block_hashes=hashes(*blocks)))
        await asyncio.sleep(0)

    async def fail(self, number: int) -> None:
        self.calls[number][1].set_exception(TimeoutError("no answer"))
        await asyncio.sleep(0)


async def started(fetches: Fetches, count: int) -> None:
    async with asyncio.timeout(5):
        while len(fetches.calls) < count:
            await asyncio.sleep(0)


async def test_batches_in_order_make_the_index() -> None:
    snapshots = Snapshots()
    replica = IndexReplica(S, snapshots.fetch)
    replica.receive(S.kv_events_from("a"), batch("a", 0, (1, 2, 3)))
    replica.receive(S.kv_events_from("a"), batch("a", 1, (4,), removed=(3,)))
    replica.receive(S.kv_events_from("b"), batch("b", 0, (1, 2)))
    assert replica.index.prefix_match(chain(1, 2, 3, 4)) == {"a": 2, "b": 2}
    assert replica.index.prefix_match(chain(4)) == {"a": 1}
    assert snapshots.asked == []  # streams from their first batch need no snapshot


async def test_a_batch_on_another_workers_subject_is_dropped() -> None:
    replica = IndexReplica(S, Snapshots().fetch)
    replica.receive(S.kv_events_from("mallory"), batch("a", 0, (1, 2)))
    replica.receive(S.kv_events_from("a"), b"not json")
    assert replica.index.prefix_match(chain(1, 2)) == {} and replica.forged_batches == 1


async def test_a_gap_resyncs_from_a_snapshot_and_replays_what_came_meanwhile() -> None:
    snapshots = Snapshots()
    snapshots.gate = asyncio.Event()
    listener = Recorder()
    replica = IndexReplica(S, snapshots.fetch, listener=listener)
    replica.receive(S.kv_events_from("a"), batch("a", 0, (1,)))
    replica.receive(S.kv_events_from("a"), batch("a", 3, (9,)))  # 1 and 2 lost
    replica.receive(S.kv_events_from("a"), batch("a", 4, removed=(2,)))  # held while the snapshot comes
    snapshots.set("a", 2, 1, 2, 3)  # as of batch 2: blocks 1, 2, 3
    snapshots.gate.set()
    await settle(replica)
    assert snapshots.asked == ["a"] and replica.resyncs == 1 and listener.gaps == ["a"]
    assert replica.index.prefix_match(chain(1, 2, 3)) == {"a": 1}  # 2 removed by batch 4
    assert replica.index.prefix_match(chain(9)) == {"a": 1}  # batch 3, replayed
    assert listener.replacements == [("a", hashes(1, 2, 3))]


async def test_a_joining_worker_is_asked_for_its_blocks_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replica_module, "JOIN_SNAPSHOT_RETRY", 0.01)
    snapshots = Snapshots()
    snapshots.set("a", 5, 7, 8)
    snapshots.failures = 1  # its first answer is lost
    replica = IndexReplica(S, snapshots.fetch)
    replica.joined("a")
    replica.joined("a")  # asked already
    await settle(replica)
    assert snapshots.asked == ["a", "a"]
    assert replica.index.prefix_match(chain(7, 8)) == {"a": 2}
    replica.receive(S.kv_events_from("a"), batch("a", 5, (99,)))  # covered by the snapshot: dropped
    replica.receive(S.kv_events_from("a"), batch("a", 6, (9,)))
    assert replica.index.prefix_match(chain(7, 8, 9)) == {"a": 3} and replica.index.prefix_match(chain(99)) == {}
    replica.joined("a")  # followed now: not asked again
    await settle(replica)
    assert snapshots.asked == ["a", "a"]


async def test_a_worker_that_leaves_during_its_snapshot_is_not_put_back() -> None:
    snapshots = Snapshots()
    snapshots.set("a", 0, 1, 2)
    snapshots.gate = asyncio.Event()
    replica = IndexReplica(S, snapshots.fetch)
    replica.joined("a")
    await asyncio.sleep(0)
    assert replica.left("a") == 0
    snapshots.gate.set()
    await settle(replica)
    assert replica.index.prefix_match(chain(1, 2)) == {} and replica.index.workers() == []


async def test_a_worker_that_left_drops_its_blocks_and_its_late_batches() -> None:
    replica = IndexReplica(S, Snapshots().fetch)
    replica.receive(S.kv_events_from("a"), batch("a", 0, (1, 2)))
    assert replica.left("a") == 2
    replica.receive(S.kv_events_from("a"), batch("a", 1, (3,)))  # its retired epoch
    assert replica.index.prefix_match(chain(1, 2)) == {} and replica.index.prefix_match(chain(3)) == {}
    replica.receive(S.kv_events_from("a"), batch("a", 0, (5,), epoch="e2"))  # restarted: a new epoch
    assert replica.index.prefix_match(chain(5)) == {"a": 1}


async def test_close_cancels_a_resync_in_flight() -> None:
    snapshots = Snapshots()
    snapshots.gate = asyncio.Event()
    replica = IndexReplica(S, snapshots.fetch)
    replica.joined("a")
    await asyncio.sleep(0)
    await replica.close()
    assert not replica._tasks


async def test_a_resync_overtaken_by_a_leave_and_a_rejoin_changes_nothing() -> None:
    """The old incarnation's snapshot, answered late, is not applied; a failure of it does not
    cancel the new incarnation's resync, nor lose what it holds meanwhile."""
    fetches = Fetches()
    replica = IndexReplica(S, fetches.fetch)
    replica.receive(S.kv_events_from("a"), batch("a", 0, (1,)))
    replica.receive(S.kv_events_from("a"), batch("a", 2, (2,)))  # batch 1 lost: a resync
    await started(fetches, 1)
    replica.left("a")
    replica.joined("a")  # restarted under the same id: asked for its blocks
    await started(fetches, 2)
    replica.receive(S.kv_events_from("a"), batch("a", 1, (7,), epoch="e2"))  # held for the new resync
    await fetches.answer(0, "a", 2, 99)  # the old incarnation's, late
    assert replica.index.prefix_match(chain(99)) == {}
    await fetches.answer(1, "a", 0, 5, epoch="e2")
    await settle(replica)
    assert replica.index.prefix_match(chain(5, 7)) == {"a": 2}
    assert replica.index.prefix_match(chain(1)) == {} and replica.index.prefix_match(chain(2)) == {}


async def test_a_failed_old_resync_leaves_the_new_one_alone() -> None:
    fetches = Fetches()
    replica = IndexReplica(S, fetches.fetch)
    replica.receive(S.kv_events_from("a"), batch("a", 0, (1,)))
    replica.receive(S.kv_events_from("a"), batch("a", 2, (2,)))
    await started(fetches, 1)
    replica.left("a")
    replica.joined("a")
    await started(fetches, 2)
    replica.receive(S.kv_events_from("a"), batch("a", 1, (7,), epoch="e2"))
    await fetches.fail(0)
    await fetches.answer(1, "a", 0, 5, epoch="e2")
    await settle(replica)
    assert replica.index.prefix_match(chain(5)) == {"a": 1} and replica.index.prefix_match(chain(7)) == {"a": 1}


async def test_a_worker_back_under_its_old_epoch_is_followed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its lease lapsed and came back (same process, same epoch) and its snapshots failed:
    its next batch is not dropped as a retired epoch's but resyncs it."""
    monkeypatch.setattr(replica_module, "JOIN_SNAPSHOT_RETRY", 0.01)
    snapshots = Snapshots()
    replica = IndexReplica(S, snapshots.fetch)
    replica.receive(S.kv_events_from("a"), batch("a", 0, (1,)))
    replica.left("a")
    snapshots.failures = replica_module.JOIN_SNAPSHOT_TRIES
    replica.joined("a")
    await settle(replica)
    assert len(snapshots.asked) == replica_module.JOIN_SNAPSHOT_TRIES
    snapshots.set("a", 1, 1, 2)
    replica.receive(S.kv_events_from("a"), batch("a", 1, (2,)))
    await settle(replica)
    assert replica.index.prefix_match(chain(1, 2)) == {"a": 2}


async def test_a_malformed_batch_is_dropped_whole() -> None:
    replica = IndexReplica(S, Snapshots().fetch)
    replica.receive(S.kv_events_from("a"), batch("a", 0, (1,)))
    bad = KVEventBatch(
        worker_id="a", epoch="e1", seq=1, block_size=16,
        events=[KVEventSpec(kind="stored", block_hashes=hashes(2)), KVEventSpec(kind="stored", block_hashes=["zz"])],
    )  # fmt: skip
    replica.receive(S.kv_events_from("a"), bad.encode())
    assert replica.index.prefix_match(chain(1, 2)) == {"a": 1}
    replica.receive(S.kv_events_from("a"), batch("a", 1, (3,)))
    assert replica.index.prefix_match(chain(1)) == {"a": 1} and replica.index.prefix_match(chain(3)) == {"a": 1}


async def test_a_gap_found_while_replaying_holds_the_rest_for_its_own_resync() -> None:
    fetches = Fetches()
    replica = IndexReplica(S, fetches.fetch)
    replica.receive(S.kv_events_from("a"), batch("a", 0, (1,)))
    replica.receive(S.kv_events_from("a"), batch("a", 3, (3,)))  # 1 and 2 lost
    await started(fetches, 1)
    replica.receive(S.kv_events_from("a"), batch("a", 5, (5,)))  # 4 lost too
    replica.receive(S.kv_events_from("a"), batch("a", 6, (6,)))
    await fetches.answer(0, "a", 2, 1, 2)  # as of batch 2: batch 3 applies, 5 is a gap again
    await started(fetches, 2)
    assert len(fetches.calls) == 2  # one resync for the second gap, 6 held for it
    await fetches.answer(1, "a", 5, 1, 2, 3, 4, 5)
    await settle(replica)
    assert replica.index.prefix_match(chain(1, 2, 3, 4, 5, 6)) == {"a": 6} and len(fetches.calls) == 2


async def test_a_worker_cannot_claim_more_blocks_than_its_pool_bound() -> None:
    """Invented hashes past the worker's bound are left out (those it holds cost nothing);
    its snapshot is cut the same way; another worker is not affected."""
    snapshots = Snapshots()
    replica = IndexReplica(S, snapshots.fetch, capacity=lambda worker: 4 if worker == "a" else None)
    replica.receive(S.kv_events_from("a"), batch("a", 0, (1, 2, 3)))
    replica.receive(S.kv_events_from("a"), batch("a", 1, (1, 2, 3, 4, 5, 6)))
    assert replica.index.blocks_of("a") == 4 and replica.index.prefix_match(chain(1, 2, 3, 4, 5)) == {"a": 4}
    assert replica.overflows == 1
    replica.receive(S.kv_events_from("a"), batch("a", 2, removed=(4,)))
    replica.receive(S.kv_events_from("a"), batch("a", 3, (7,)))  # room again
    assert replica.index.prefix_match(chain(7)) == {"a": 1}
    replica.receive(S.kv_events_from("b"), batch("b", 0, tuple(range(10, 30))))
    assert replica.index.blocks_of("b") == 20
    snapshots.set("a", 9, *range(100, 110))
    replica.receive(S.kv_events_from("a"), batch("a", 10, ()))  # a gap: resynced from a 10-block snapshot
    await settle(replica)
    assert replica.index.blocks_of("a") == 4


def test_the_pool_bound_comes_from_the_workers_record() -> None:
    from kvmesh.kvindex.replica import CAPACITY_MARGIN, pool_capacity
    from kvmesh.protocol import KVLayoutSpec, WorkerRecord

    layout = KVLayoutSpec(num_blocks=64, block_size=16, num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")
    record = WorkerRecord(
        worker_id="a", role="decode", model="m", max_model_len=128, subject="s", host="h", pid=1, started_at=0.0, kv_layout=layout
    )
    assert pool_capacity(record) == CAPACITY_MARGIN * 64 and pool_capacity(None) is None
    assert pool_capacity(record.model_copy(update={"kv_layout": None})) is None


class Recorder(ReplicaListener):
    def __init__(self) -> None:
        self.gaps: list[str] = []
        self.replacements: list[tuple[str, list[str]]] = []

    def gap(self, worker_id: str) -> None:
        self.gaps.append(worker_id)

    def replaced(self, worker_id: str, hashes: list[str], tier: str) -> None:
        self.replacements.append((worker_id, hashes))


async def test_batches_held_while_a_snapshot_comes_are_bounded_and_the_rest_resynced() -> None:
    """A worker that sends batch after batch while its snapshot does not come costs at most
    ``MAX_HELD_BATCHES`` held; the dropped ones are made up by a second snapshot at once."""
    fetches = Fetches()
    replica = IndexReplica(S, fetches.fetch)
    replica.receive(S.kv_events_from("a"), batch("a", 0, (1,)))
    replica.receive(S.kv_events_from("a"), batch("a", 2, (2,)))  # 1 lost: a resync
    await started(fetches, 1)
    for seq in range(3, 3 + 3 * replica_module.MAX_HELD_BATCHES):
        replica.receive(S.kv_events_from("a"), batch("a", seq, (seq,)))
    assert len(replica._resyncing["a"]) == replica_module.MAX_HELD_BATCHES
    await fetches.answer(0, "a", 1, 1)  # as of batch 1: the held batches 2.. apply on top
    await started(fetches, 2)  # and the dropped ones are asked for at once
    last = 2 + 3 * replica_module.MAX_HELD_BATCHES
    assert replica.index.blocks_of("a") == 1 + replica_module.MAX_HELD_BATCHES
    await fetches.answer(1, "a", last, 1, *range(2, last + 1))
    await settle(replica)
    assert replica.index.blocks_of("a") == last and len(fetches.calls) == 2
    replica.receive(S.kv_events_from("a"), batch("a", last + 1, (9999,)))  # followed again
    assert replica.index.blocks_of("a") == last + 1
