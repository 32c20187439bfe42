"""Engines are loaded on a thread that has ended by the time the engine steps
(``kvmesh.engine.own_thread``): a live loading thread keeps an OpenMP pool that halves the
speed of every step on the engine thread."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import cast

import pytest

from kvmesh.engine import async_engine
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.own_thread import call_in_own_thread, run_in_own_thread
from kvmesh.engine.request import SamplingParams
from kvmesh.worker import kvmesh_engine, vllm_engine
from kvmesh.worker.engines import create_engine
from kvmesh.worker.kvmesh_engine import KvmeshEngine
from kvmesh.worker.vllm_engine import VllmEngine
from kvmesh.settings.worker import EngineSettings


async def test_the_work_runs_on_a_thread_that_has_ended_when_it_returns():
    ran_on: list[threading.Thread] = []

    def work() -> int:
        ran_on.append(threading.current_thread())
        return 42

    assert await run_in_own_thread(work, "loading") == 42
    (thread,) = ran_on
    assert thread is not threading.current_thread()
    assert thread.name == "loading"
    assert not thread.is_alive()


async def test_a_failure_reaches_the_caller_after_the_thread_ended():
    ran_on: list[threading.Thread] = []

    def work() -> None:
        ran_on.append(threading.current_thread())
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        await run_in_own_thread(work, "loading")
    assert not ran_on[0].is_alive()


async def test_the_event_loop_runs_meanwhile():
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    await run_in_own_thread(lambda: time.sleep(0.3), "loading")
    ticker.cancel()
    assert ticks >= 10


def test_the_blocking_form_returns_or_raises_after_its_thread_ended():
    ran_on: list[threading.Thread] = []

    def work(fail: bool) -> str:
        ran_on.append(threading.current_thread())
        if fail:
            raise RuntimeError("transfer failed")
        return "done"

    assert call_in_own_thread(lambda: work(False), "transfer") == "done"
    with pytest.raises(RuntimeError, match="transfer failed"):
        call_in_own_thread(lambda: work(True), "transfer")
    assert len(ran_on) == 2 and not any(t.is_alive() or t is threading.current_thread() for t in ran_on)


@pytest.fixture
def built_on(monkeypatch) -> list[threading.Thread]:
    """The threads LLMEngines were built on (the real engine, recorded), for both creators."""
    threads: list[threading.Thread] = []

    class RecordingEngine(LLMEngine):
        def __init__(self, config: EngineConfig | None = None) -> None:
            threads.append(threading.current_thread())
            super().__init__(config)

    monkeypatch.setattr(async_engine, "LLMEngine", RecordingEngine)
    monkeypatch.setattr(kvmesh_engine, "LLMEngine", RecordingEngine)
    return threads


def tiny(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), block_size=4, num_blocks=64, num_threads=2)


async def through_the_worker(model_dir) -> KvmeshEngine:
    """As a worker loads its engine: ``create_engine`` with the worker's engine settings."""
    settings = EngineSettings(model=str(model_dir), block_size=4, kv_cache_bytes=4 * 2**20, num_threads=2)
    return cast(KvmeshEngine, await create_engine(settings))


@pytest.mark.parametrize(
    "create",
    [lambda model_dir: AsyncEngine.create(tiny(model_dir)), through_the_worker],
    ids=["AsyncEngine.create", "the worker's create_engine"],
)
async def test_an_engine_is_loaded_on_a_thread_that_has_ended(create, built_on, tiny_model_dir):
    # the code before loaded it with asyncio.to_thread: on the default executor's thread,
    # which lives on (with its OpenMP pool) while the engine thread steps
    async with await create(tiny_model_dir) as engine:
        (loader,) = built_on
        assert loader is not threading.current_thread() and loader is not engine._thread
        assert not loader.is_alive()
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        outputs = [out async for out in engine.generate("r", [1, 2, 3, 4, 5], params)]
        assert sum(len(out.new_token_ids) for out in outputs) == 3


async def test_a_vllm_engine_is_loaded_on_a_thread_that_has_ended(monkeypatch):
    loaders: list[threading.Thread] = []

    def build(cls, settings: EngineSettings) -> str:
        loaders.append(threading.current_thread())
        return "built"

    monkeypatch.setattr(VllmEngine, "build", classmethod(build))
    assert await vllm_engine.VllmEngine.start(EngineSettings(name="vllm")) == "built"
    assert not loaders[0].is_alive() and loaders[0] is not threading.current_thread()
