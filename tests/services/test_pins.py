"""Pins against a real etcd: released once, by the pull, by lease expiry or by the deadline."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.cluster.etcd_store import EtcdStore
from kvmesh.infra.servers import start_etcd
from kvmesh.services.prefill_worker.pins import PinTable

PREFIX = "/kvmesh/test/pins/p1/"


@pytest.fixture
async def store(tmp_path):
    server = await asyncio.to_thread(start_etcd, tmp_path)
    async with EtcdStore([server.endpoint], timeout=3) as s:
        yield s
    server.stop()


class Blocks:
    def __init__(self) -> None:
        self.released: list[str] = []

    async def __call__(self, request_id: str) -> bool:
        self.released.append(request_id)
        return True


async def until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)


async def test_pulled_pin_is_released_once_and_its_key_goes(store):
    blocks = Blocks()
    table = PinTable(store, PREFIX, ttl=5, release_blocks=blocks, write_delay=0)
    await table.start()
    pin = table.pin("r1", b"p1", 4096)
    await until(lambda: pin.lease_id is not None)
    assert (await store.get(PREFIX + "r1")) is not None
    assert await table.release("r1", reason="pulled") is pin
    assert await table.release("r1", reason="pulled") is None
    for _ in range(50):
        if await store.get(PREFIX + "r1") is None:
            break
        await asyncio.sleep(0.05)
    assert await store.get(PREFIX + "r1") is None
    assert blocks.released == ["r1"] and table.released == 1 and len(table) == 0
    await table.stop()


async def test_unpulled_pin_is_freed_when_its_lease_expires(store):
    blocks = Blocks()
    table = PinTable(store, PREFIX, ttl=1, release_blocks=blocks, write_delay=0)
    await table.start()
    table.pin("r2", b"p1", 4096)
    await until(lambda: blocks.released == ["r2"], timeout=8)  # the TTL is really waited out
    assert len(table) == 0 and table.expired == 1
    await table.stop()


async def test_a_pin_pulled_before_its_write_is_due_never_touches_etcd(store):
    blocks = Blocks()
    table = PinTable(store, PREFIX, ttl=30, release_blocks=blocks, write_delay=0.3)
    await table.start()
    pin = table.pin("r6", b"p1", 4096)
    await asyncio.sleep(0.05)  # a pull's usual time
    assert await table.release("r6", reason="pulled") is pin
    await until(lambda: table.unwritten == 1)
    await asyncio.sleep(0.3)
    assert pin.lease_id is None and await store.get(PREFIX + "r6") is None
    assert blocks.released == ["r6"] and table.released == 1
    await table.stop()


async def test_a_pin_held_past_the_delay_is_written_after_it(store):
    table = PinTable(store, PREFIX, ttl=30, release_blocks=Blocks(), write_delay=0.3)
    await table.start()
    pin = table.pin("r7", b"p1", 4096)
    await asyncio.sleep(0.15)
    assert await store.get(PREFIX + "r7") is None  # not yet due
    await until(lambda: pin.lease_id is not None)
    assert await store.get(PREFIX + "r7") is not None
    await table.stop()


async def test_release_before_the_etcd_write_lands_revokes_after(store):
    blocks = Blocks()
    table = PinTable(store, PREFIX, ttl=30, release_blocks=blocks, write_delay=0)
    await table.start()
    pin = table.pin("r3", b"p1", 4096)
    await asyncio.sleep(0)  # the write has started
    await table.release("r3", reason="pulled")  # before the background write finished
    await until(lambda: pin.lease_id is not None)
    for _ in range(50):
        if await store.get(PREFIX + "r3") is None:
            break
        await asyncio.sleep(0.05)
    assert await store.get(PREFIX + "r3") is None
    assert blocks.released == ["r3"]
    await table.stop()


async def test_stop_frees_what_is_still_pinned(store):
    blocks = Blocks()
    table = PinTable(store, PREFIX, ttl=30, release_blocks=blocks, write_delay=1.0)
    await table.start()
    table.pin("r4", b"p1", 1)
    table.pin("r5", b"p1", 1)
    await table.stop()
    assert sorted(blocks.released) == ["r4", "r5"]
