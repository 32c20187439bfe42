"""Worker registration under leases and the live directory, against a real etcd."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from kvmesh.cluster.directory import WorkerDirectory
from kvmesh.cluster.etcd_store import ClusterError, EtcdStore
from kvmesh.cluster.registration import LeasedKey
from kvmesh.infra.servers import start_etcd
from kvmesh.protocol import Keys, WorkerRecord
from tests.cancellation import sleep_swallowing_cancellation

KEYS = Keys("test")


def record(worker_id: str, role: str = "prefill") -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id, role=role, model="m", max_model_len=2048, subject=f"s.{worker_id}", host="127.0.0.1", pid=os.getpid(), started_at=time.time()
    )


@pytest.fixture
async def etcd(tmp_path):
    server = await asyncio.to_thread(start_etcd, tmp_path)
    yield server
    server.stop()


@pytest.fixture
async def store(etcd):
    async with EtcdStore([etcd.endpoint], timeout=3.0) as s:
        yield s


async def test_registration_shows_in_directory_and_leaves_on_stop(store):
    directory = WorkerDirectory(store, KEYS)
    await directory.start()
    try:
        a = LeasedKey(store, KEYS.worker("prefill", "a"), record("a").encode(), ttl=2)
        await a.start()
        await directory.wait_for(lambda d: "a" in d.workers, timeout=5)
        assert [r.worker_id for r in directory.alive("prefill")] == ["a"]
        assert directory.alive("decode") == []
        await a.stop()  # drained: revoked at once
        await directory.wait_for(lambda d: "a" not in d.workers, timeout=5)
    finally:
        await directory.stop()


async def test_a_dead_worker_leaves_when_its_lease_expires(store):
    directory = WorkerDirectory(store, KEYS)
    await directory.start()
    try:
        b = LeasedKey(store, KEYS.worker("decode", "b"), record("b", "decode").encode(), ttl=1)
        await b.start()
        await directory.wait_for(lambda d: "b" in d.workers, timeout=5)
        started = time.monotonic()
        await b.stop(revoke=False)  # as if killed: nobody refreshes the lease any more
        await directory.wait_for(lambda d: "b" not in d.workers, timeout=10)
        assert 0.5 < time.monotonic() - started < 6  # the TTL was really waited out
    finally:
        await directory.stop()


async def test_lease_lost_means_registering_again(store):
    c = LeasedKey(store, KEYS.worker("prefill", "c"), record("c").encode(), ttl=2)
    await c.start()
    first_lease = c.lease_id
    await store.revoke(first_lease)  # as if etcd forgot the lease
    for _ in range(50):
        if c.registrations > 1:
            break
        await asyncio.sleep(0.1)
    assert c.registrations == 2 and c.lease_id != first_lease
    assert (await store.get(KEYS.worker("prefill", "c"))) is not None
    await c.stop()


async def test_a_lost_registration_does_not_overwrite_the_records_new_holder(store):
    """Cut off past its lease while a replica took its identity, a worker used to put its
    record back over the new holder's, and its revoke at stop then deleted that record."""
    key = KEYS.worker("decode", "e")
    old = LeasedKey(store, key, record("e", "decode").encode(), ttl=2)
    await old.start()
    await old.stop(revoke=False)  # cut off: nobody refreshes its lease
    await store.revoke(old.lease_id)  # its lease ended
    new = LeasedKey(store, key, b"the new holder's record", ttl=2)
    await new.start()
    old._task = asyncio.create_task(old._keep_alive())  # back on the network
    for _ in range(50):
        if old.lease_id == 0:
            break
        await asyncio.sleep(0.1)
    assert old.lease_id == 0 and old.registrations == 1
    assert (await store.get(key)).value == b"the new holder's record"  # type: ignore[union-attr]
    await old.stop()
    assert (await store.get(key)).value == b"the new holder's record"  # type: ignore[union-attr]
    await new.stop()
    assert (await store.get(key)) is None


async def test_a_claimed_identitys_registration_never_replaces_a_record_there(store):
    """With identity slots a worker's record key was absent at its claim: one there when it
    registers is the holder's that took the identity since, and its start fails instead of
    overwriting it (and deleting it at its revoke)."""
    key = KEYS.worker("decode", "f")
    holder = LeasedKey(store, key, b"the holder's record", ttl=2)
    await holder.start()
    late = LeasedKey(store, key, record("f", "decode").encode(), ttl=2, replace=False)
    with pytest.raises(ClusterError, match="registered by another holder"):
        await late.start()
    assert (await store.get(key)).value == b"the holder's record"  # type: ignore[union-attr]
    await late.stop()
    await holder.stop()


async def test_etcd_restart_is_survived(tmp_path):
    server = await asyncio.to_thread(start_etcd, tmp_path)
    endpoint = server.endpoint
    async with EtcdStore([endpoint], timeout=2.0) as store:
        directory = WorkerDirectory(store, KEYS)
        await directory.start()
        d = LeasedKey(store, KEYS.worker("prefill", "d"), record("d").encode(), ttl=2)
        await d.start()
        await directory.wait_for(lambda x: "d" in x.workers, timeout=5)
        server.stop()
        with pytest.raises(ClusterError):
            await store.put("/x", b"y")
        # Same data dir, same port: etcd comes back with its keys and leases.
        server = await asyncio.to_thread(start_etcd, tmp_path, port=server.port)
        try:
            await asyncio.sleep(3)
            await directory.wait_for(lambda x: "d" in x.workers, timeout=10)
            assert (await store.get(KEYS.worker("prefill", "d"))) is not None
        finally:
            await d.stop()
            await directory.stop()
            server.stop()


async def test_unreachable_etcd_is_a_clear_error():
    async with EtcdStore(["127.0.0.1:9"], timeout=0.5) as store:
        with pytest.raises(ClusterError, match="etcd put"):
            await store.put("/k", b"v")


async def test_a_large_batch_is_written_in_transactions_etcd_accepts(store):
    keys = [f"/batch/{i:04d}" for i in range(300)]  # more than etcd's 128 operations a transaction
    await store.write_batch([(k, b"v", 0) for k in keys], [])
    items, _ = await store.get_prefix("/batch/")
    assert [i.key for i in items] == keys
    await store.write_batch([], keys[:200])
    items, _ = await store.get_prefix("/batch/")
    assert [i.key for i in items] == keys[200:]
    assert await store.delete_prefix("/batch/") == 100


def test_advertise_host_auto_resolves_this_hosts_address():
    import socket

    from kvmesh.settings.worker import resolve_advertise_host

    assert resolve_advertise_host("auto") == socket.gethostbyname(socket.gethostname())
    assert resolve_advertise_host("10.1.2.3") == "10.1.2.3"


class _SwallowingStore:
    """An etcd store whose lease refresh returns a TTL even when its caller is cancelled in the
    middle of it, as ``asyncio.wait_for`` does on Python 3.11 when the call ends at that moment."""

    def __init__(self) -> None:
        self.refreshing = asyncio.Event()
        self.revoked: list[int] = []

    async def grant(self, ttl: int) -> int:
        return 7

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> None:
        pass

    async def revoke(self, lease_id: int) -> None:
        self.revoked.append(lease_id)

    async def refresh(self, lease_id: int) -> int:
        self.refreshing.set()
        await sleep_swallowing_cancellation(0.5)
        return 3


async def test_a_keep_alive_stops_even_when_a_refresh_swallowed_the_stop():
    """A worker's record stops being refreshed and is revoked at once, even when the stop came
    while a refresh ended (once its keep-alive went back to sleep for good, and the stop, and a
    CI run with it, hung)."""
    store = _SwallowingStore()
    key = LeasedKey(store, KEYS.worker("prefill", "d"), b"record", ttl=1)  # type: ignore[arg-type]
    await key.start()
    await store.refreshing.wait()
    started = time.monotonic()
    async with asyncio.timeout(5):
        await key.stop()
    assert store.revoked == [7] and key.lease_id is None
    assert time.monotonic() - started < 2  # the loop saw the stop itself, no second cancel needed


class _KVAnsweringAsItsCallerIsCancelled:
    """An etcd KV service whose ``get`` answers in the same loop turn as its caller's task is
    cancelled: the race in which ``asyncio.wait_for`` on Python 3.11 returns the answer and
    drops the cancellation."""

    def __init__(self, caller: list[asyncio.Task]) -> None:
        self.caller = caller

    async def get(self, key: str, range_end: str | None = None, *, timeout: float | None = None):
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()

        def answer_and_cancel() -> None:
            answer.set_result(_Response())
            self.caller[0].cancel()

        loop.call_soon(answer_and_cancel)
        return await answer


class _Response:
    kvs: list = []


async def test_a_store_call_keeps_its_callers_cancellation():
    """A task cancelled as its etcd call answers ends cancelled, not with the answer (with the
    answer, a loop around such a call went on after its stop)."""
    store = EtcdStore(["127.0.0.1:9"], timeout=5)  # never connected: the KV service is the fake
    caller: list[asyncio.Task] = []
    store._client.kv = _KVAnsweringAsItsCallerIsCancelled(caller)  # type: ignore[assignment]

    async def get_then_record() -> str:
        await store.get("/k")
        return "went on after its cancellation"

    caller.append(asyncio.create_task(get_then_record()))
    with pytest.raises(asyncio.CancelledError):
        await caller[0]
