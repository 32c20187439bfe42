"""A decode worker admits a pull only while every running request can still grow by a
block (else they preempt each other and recompute) and the engine's admission takes it
(its sampling parameters go to the engine); a retried request only needs the blocks; while
there is no room it waits, then answers overloaded."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvmesh.errors import ErrorCode, MeshError
from kvmesh.services.decode_worker.main import DecodeWorker
from kvmesh.settings.mesh import MeshSettings
from kvmesh.settings.worker import WorkerSettings
from kvmesh.worker.engine_api import SamplingParams
from kvmesh.worker.runtime import WorkerRuntime


class Engine:
    def __init__(self, free: int, running: int) -> None:
        self.free, self.running = free, running
        self.kv_layout = SimpleNamespace(block_size=16)
        self.allocated: list[str] = []
        self.admits = True  # the engine's own admission
        self.asked: list[tuple[SamplingParams | None, bool]] = []  # (params, resumed) of each try

    def load_now(self) -> dict[str, int]:
        return {"running": self.running, "waiting": 0, "free_blocks": self.free}

    async def allocate_import(self, handle: str, num_tokens: int, params: SamplingParams | None = None, resumed: bool = False) -> list[int] | None:
        self.asked.append((params, resumed))
        needed = -(-num_tokens // 16)
        if needed > self.free or (params is not None and not resumed and not self.admits):
            return None
        self.free -= needed
        self.allocated.append(handle)
        return list(range(needed))


def worker(engine: Engine, import_wait: float = 5.0, pin_ttl: int = 30) -> DecodeWorker:
    settings = SimpleNamespace(import_wait=import_wait, pin_ttl=pin_ttl)
    return DecodeWorker(SimpleNamespace(engine=engine, settings=settings))  # type: ignore[arg-type]


async def test_a_new_pull_waits_until_running_requests_keep_room_to_grow():
    engine = Engine(free=8, running=5)  # 4 blocks for the pull would leave 4 for 5 running requests
    pull = asyncio.create_task(worker(engine)._allocate_import("new", 64, SamplingParams(max_tokens=7)))
    await asyncio.sleep(0.2)
    assert not pull.done() and engine.allocated == []
    engine.free = 9  # 9 - 4 = 5: each running request can take one more block
    assert await asyncio.wait_for(pull, 2) == [0, 1, 2, 3]
    assert [(p.max_tokens if p else None, resumed) for p, resumed in engine.asked] == [(7, False)]


async def test_a_new_pull_waits_while_the_engine_holds_it_back():
    engine = Engine(free=20, running=1)
    engine.admits = False  # kvmesh's engine keeps room for the running requests' growth
    pull = asyncio.create_task(worker(engine)._allocate_import("new", 64, SamplingParams(max_tokens=7)))
    await asyncio.sleep(0.2)
    assert not pull.done() and engine.allocated == [] and len(engine.asked) > 1
    engine.admits = True
    assert await asyncio.wait_for(pull, 2) == [0, 1, 2, 3]


async def test_a_retried_pull_only_needs_the_blocks():
    engine = Engine(free=8, running=5)
    engine.admits = False
    assert await asyncio.wait_for(worker(engine)._allocate_import("retry", 64, SamplingParams(), resumed=True), 1) == [0, 1, 2, 3]
    assert [resumed for _, resumed in engine.asked] == [True]  # the engine's admission skipped: a stream mid-answer


async def test_no_room_in_time_is_overloaded():
    engine = Engine(free=2, running=0)
    with pytest.raises(MeshError) as err:
        await asyncio.wait_for(worker(engine, import_wait=0.3)._allocate_import("big", 64, SamplingParams()), 2)
    assert err.value.code is ErrorCode.OVERLOADED and engine.allocated == []


async def test_pulls_take_room_in_the_order_they_came():
    # the first pull needs 4 blocks; a later one needing 1 would fit now, but waits its turn
    engine = Engine(free=3, running=0)
    w = worker(engine)
    first = asyncio.create_task(w._allocate_import("first", 64, SamplingParams()))
    await asyncio.sleep(0.1)
    later = asyncio.create_task(w._allocate_import("later", 16, SamplingParams()))
    await asyncio.sleep(0.2)
    assert engine.allocated == [] and len(w.import_line) == 2
    engine.free = 5
    await asyncio.wait_for(asyncio.gather(first, later), 2)
    assert engine.allocated == ["first", "later"] and len(w.import_line) == 0


async def test_a_retried_pull_goes_ahead_of_new_ones_and_a_timed_out_one_leaves_the_line():
    engine = Engine(free=3, running=0)
    w = worker(engine, import_wait=2.0)
    new = asyncio.create_task(w._allocate_import("new", 64, SamplingParams()))
    await asyncio.sleep(0.1)
    retried = asyncio.create_task(w._allocate_import("retried", 48, SamplingParams(), resumed=True))
    assert await asyncio.wait_for(retried, 0.5) == [0, 1, 2]
    assert not new.done()  # ahead of new, which still waits for its 4 blocks
    with pytest.raises(MeshError):
        await asyncio.wait_for(new, 3)
    assert engine.allocated == ["retried"] and len(w.import_line) == 0


async def test_no_wait_outlives_the_prefills_pin():
    engine = Engine(free=2, running=0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(MeshError):  # the pin lasts 6 s: 1 s of waiting, 5 s left for the pull
        await asyncio.wait_for(worker(engine, import_wait=25, pin_ttl=6)._allocate_import("big", 64, SamplingParams()), 5)
    assert 0.9 < loop.time() - started < 2


async def test_the_producers_pin_bounds_the_wait_not_this_workers():
    # a prefill worker whose pins last 6 s (its --pin-ttl), this decode worker's 30: the wait
    # ends after 1 s, leaving the pull 5 s of the producer's pin
    engine = Engine(free=2, running=0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(MeshError):
        await asyncio.wait_for(worker(engine, import_wait=25, pin_ttl=30)._allocate_import("big", 64, SamplingParams(), pin_ttl=6.0), 5)
    assert 0.9 < loop.time() - started < 2


def test_pulls_waiting_in_line_count_as_waiting_in_the_load_the_router_hears():
    rt = WorkerRuntime(WorkerSettings(role="decode", mesh=MeshSettings("nats://127.0.0.1:1", ("127.0.0.1:1",))))
    load = {"running": 3, "waiting": 1, "free_blocks": 0}
    rt.engine = SimpleNamespace(load_now=lambda: load, kv_layout=SimpleNamespace(num_blocks=10), is_alive=lambda: True, heartbeat_age=lambda: 0.0)  # type: ignore[assignment]
    decode = DecodeWorker(rt)
    decode.import_line.join(retried=False)
    decode.import_line.join(retried=True)
    report = rt.load_report()
    assert (report.running, report.waiting, report.free_blocks) == (3, 3, 0)
