"""kv-metadata against real nats-server and etcd, fed by stand-in workers that publish the
same event batches and answer the same snapshot requests as real ones."""

from __future__ import annotations

import asyncio
import os
import time

import nats
import pytest

from kvmesh.cluster.etcd_store import EtcdStore
from kvmesh.cluster.registration import LeasedKey
from kvmesh.hashing import hash_to_hex, hash_token_blocks
from kvmesh.infra.servers import start_etcd, start_nats
from kvmesh.protocol import KVEventBatch, KVEventSpec, KVIndexStats, KVQuery, KVQueryReply, KVSnapshot, Keys, Subjects, WorkerRecord
from kvmesh.services.kv_metadata.main import KVMetadataService
from kvmesh.settings.mesh import MeshSettings
from tests.cancellation import sleep_swallowing_cancellation

NS = "kvtest"
SUBJECTS, KEYS = Subjects(NS), Keys(NS)
CHAIN = [hash_to_hex(h) for h in hash_token_blocks(list(range(64)), 16, ("m",))]  # 4 blocks
OTHER = [hash_to_hex(h) for h in hash_token_blocks(list(range(100, 132)), 16, ("m",))]  # 2 blocks


@pytest.fixture
async def servers(tmp_path):
    nats_server = await asyncio.to_thread(start_nats, tmp_path)
    etcd = await asyncio.to_thread(start_etcd, tmp_path)
    yield nats_server, etcd
    etcd.stop()
    nats_server.stop()


class StandInWorker:
    """Registers like a worker, publishes KV event batches, answers snapshot requests."""

    def __init__(self, nc, store, worker_id: str, ttl: int = 2) -> None:
        self.nc, self.store, self.worker_id = nc, store, worker_id
        self.seq = -1
        self.blocks: list[str] = []
        record = WorkerRecord(worker_id=worker_id, role="prefill", model="m", max_model_len=64, subject="s", host="h", pid=os.getpid(), started_at=time.time())
        self.registration = LeasedKey(store, KEYS.worker("prefill", worker_id), record.encode(), ttl=ttl)

    async def start(self) -> None:
        await self.registration.start()

        async def snapshot(msg):
            await msg.respond(KVSnapshot(worker_id=self.worker_id, epoch="e1", seq=self.seq, block_hashes=self.blocks).encode())

        await self.nc.subscribe(SUBJECTS.kv_snapshot(self.worker_id), cb=snapshot)

    async def publish(self, *events: KVEventSpec, skip: int = 0) -> None:
        self.seq += 1 + skip
        for event in events:
            if event.kind == "stored":
                self.blocks += [h for h in event.block_hashes if h not in self.blocks]
            elif event.kind == "removed":
                self.blocks = [h for h in self.blocks if h not in event.block_hashes]
        batch = KVEventBatch(worker_id=self.worker_id, epoch="e1", seq=self.seq, block_size=16, events=list(events))
        await self.nc.publish(SUBJECTS.kv_events_from(self.worker_id), batch.encode())


def stored(hashes: list[str]) -> KVEventSpec:
    return KVEventSpec(kind="stored", block_hashes=hashes)


async def query(nc, chain: list[str]) -> dict[str, int]:
    reply = await nc.request(SUBJECTS.kv_query, KVQuery(block_hashes=chain).encode(), timeout=5)
    return KVQueryReply.decode(reply.data).matches


async def eventually(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result or time.monotonic() > deadline:
            return result
        await asyncio.sleep(0.05)


async def test_index_follows_events_resyncs_on_gaps_and_drops_dead_workers(servers):
    nats_server, etcd = servers
    mesh = MeshSettings(nats_url=nats_server.url, etcd_endpoints=(etcd.endpoint,), namespace=NS, request_timeout=5)
    service = KVMetadataService(mesh, service_id="kvm-1", mirror_interval=0.05)
    await service.start()
    nc = await nats.connect(nats_server.url)
    async with EtcdStore([etcd.endpoint]) as store:
        a, b = StandInWorker(nc, store, "a"), StandInWorker(nc, store, "b", ttl=1)
        await a.start()
        await b.start()
        try:
            await service.directory.wait_for(lambda d: {"a", "b"} <= set(d.workers), timeout=5)
            await a.publish(stored(CHAIN))
            await b.publish(stored(CHAIN[:2]), stored(OTHER))
            assert await eventually(lambda: _matches(nc, CHAIN, {"a": 4, "b": 2}))
            await a.publish(KVEventSpec(kind="removed", block_hashes=[CHAIN[1]]))
            assert await eventually(lambda: _matches(nc, CHAIN, {"a": 1, "b": 2}))  # a hole stops a's count

            # A lost batch: the next one shows a gap, the service resyncs from a snapshot.
            a.blocks.append(CHAIN[1])  # what the lost batch said
            await a.publish(stored(OTHER), skip=1)
            assert await eventually(lambda: _matches(nc, CHAIN, {"a": 4, "b": 2}))
            assert service.resyncs == 1

            # Ownership is mirrored under each owner's lease.
            async def mirrored():
                items, _ = await store.get_prefix(KEYS.blocks("a"))
                return {i.key.rsplit("/", 1)[1] for i in items} == set(CHAIN + OTHER)

            assert await eventually(mirrored)

            # b dies (nobody refreshes its lease): its blocks leave the index within the TTL.
            await b.registration.stop(revoke=False)
            started = time.monotonic()
            assert await eventually(lambda: _matches(nc, CHAIN, {"a": 4}), timeout=10)
            assert time.monotonic() - started < 6
            assert (await store.get_prefix(KEYS.blocks("b")))[0] == []  # gone from etcd by itself

            stats = KVIndexStats.decode((await nc.request(SUBJECTS.kv_stats, b"", timeout=5)).data)
            assert stats.workers == {"a": 6} and stats.queries > 0 and stats.resyncs == 1
        finally:
            await a.registration.stop()
            await nc.close()
            await service.close()


async def test_a_restarted_service_rebuilds_the_same_index_from_etcd(servers):
    nats_server, etcd = servers
    mesh = MeshSettings(nats_url=nats_server.url, etcd_endpoints=(etcd.endpoint,), namespace=NS, request_timeout=5)
    first = KVMetadataService(mesh, service_id="kvm-1", mirror_interval=0.05)
    await first.start()
    nc = await nats.connect(nats_server.url)
    async with EtcdStore([etcd.endpoint]) as store:
        a = StandInWorker(nc, store, "a", ttl=5)
        await a.start()
        try:
            await first.directory.wait_for(lambda d: "a" in d.workers, timeout=5)
            await a.publish(stored(CHAIN), stored(OTHER))
            assert await eventually(lambda: _matches(nc, CHAIN, {"a": 4}))
            before = {tuple(c): await query(nc, c) for c in (CHAIN, OTHER, CHAIN[:2])}
            await first.close()  # flushes the mirror

            second = KVMetadataService(mesh, service_id="kvm-2", mirror_interval=0.05)
            await second.start()
            try:
                assert second.index.num_blocks == 6  # before any new event arrived
                after = {tuple(c): await query(nc, c) for c in (CHAIN, OTHER, CHAIN[:2])}
                assert after == before
            finally:
                await second.close()
        finally:
            await a.registration.stop()
            await nc.close()


async def _matches(nc, chain, want) -> bool:
    return await query(nc, chain) == want


class _SwallowingStore:
    """An etcd store whose batch write returns normally when its caller is cancelled in the
    middle of it, as ``asyncio.wait_for`` does on Python 3.11 when the call ends at that moment."""

    def __init__(self) -> None:
        self.writing = asyncio.Event()

    async def write_batch(self, puts: list, deletes: list) -> None:
        self.writing.set()
        await sleep_swallowing_cancellation(0.3)


async def test_the_etcd_mirror_stops_even_when_a_write_swallowed_the_stop():
    """The mirror's loop ends at its stop even when the stop came while a flush's write ended
    (it went on flushing beside the service's own last flush, after the store closed)."""
    from kvmesh.services.kv_metadata.mirror import EtcdMirror

    store = _SwallowingStore()
    mirror = EtcdMirror(store, Keys("default"), lambda worker_id: 7)  # type: ignore[arg-type]
    mirror.stored("prefill-1", ["ab"], "device")
    task = asyncio.create_task(mirror.run(0.01))
    await store.writing.wait()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2)
    assert done and task.cancelled()
