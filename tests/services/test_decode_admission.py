"""A decode worker admits a pull only while every running request can still grow by a
block (else they preempt each other and recompute); a retried request only needs the
blocks; while there is no room it waits, then answers overloaded."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvmesh.errors import ErrorCode, MeshError
from kvmesh.services.decode_worker.main import DecodeWorker


class Engine:
    def __init__(self, free: int, running: int) -> None:
        self.free, self.running = free, running
        self.kv_layout = SimpleNamespace(block_size=16)
        self.allocated: list[str] = []

    def load_now(self) -> dict[str, int]:
        return {"running": self.running, "waiting": 0, "free_blocks": self.free}

    async def allocate_import(self, handle: str, num_tokens: int) -> list[int] | None:
        needed = -(-num_tokens // 16)
        if needed > self.free:
            return None
        self.free -= needed
        self.allocated.append(handle)
        return list(range(needed))


def worker(engine: Engine, import_wait: float = 5.0) -> DecodeWorker:
    return DecodeWorker(SimpleNamespace(engine=engine, settings=SimpleNamespace(import_wait=import_wait)))  # type: ignore[arg-type]


async def test_a_new_pull_waits_until_running_requests_keep_room_to_grow():
    engine = Engine(free=8, running=5)  # 4 blocks for the pull would leave 4 for 5 running requests
    pull = asyncio.create_task(worker(engine)._allocate_import("new", 64))
    await asyncio.sleep(0.2)
    assert not pull.done() and engine.allocated == []
    engine.free = 9  # 9 - 4 = 5: each running request can take one more block
    assert await asyncio.wait_for(pull, 2) == [0, 1, 2, 3]


async def test_a_retried_pull_only_needs_the_blocks():
    engine = Engine(free=8, running=5)
    assert await asyncio.wait_for(worker(engine)._allocate_import("retry", 64, resumed=True), 1) == [0, 1, 2, 3]


async def test_no_room_in_time_is_overloaded():
    engine = Engine(free=2, running=0)
    with pytest.raises(MeshError) as err:
        await asyncio.wait_for(worker(engine, import_wait=0.3)._allocate_import("big", 64), 2)
    assert err.value.code is ErrorCode.OVERLOADED and engine.allocated == []
