"""A worker whose engine dies stops serving and exits non-zero (so a supervisor restarts
it), and its health checks say so meanwhile; never a live process with a dead engine."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvmesh.engine.async_engine import AsyncEngine, EngineDeadError
from kvmesh.engine.llm_engine import EngineConfig
from kvmesh.engine.request import SamplingParams
from kvmesh.worker.runtime import WorkerRuntime
from kvmesh.settings.mesh import MeshSettings
from kvmesh.settings.worker import WorkerSettings


def runtime() -> WorkerRuntime:
    return WorkerRuntime(WorkerSettings(role="decode", mesh=MeshSettings("nats://127.0.0.1:1", ("127.0.0.1:1",))))


async def test_a_dead_engine_ends_the_worker_with_a_non_zero_exit(tiny_model_dir, monkeypatch):
    rt = runtime()
    assert rt.health_status().live and not rt.health_status().ready  # loading: live, not ready
    rt.engine = await AsyncEngine.create(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=64, max_failed_steps=1))
    watch = asyncio.create_task(rt._watch_engine())
    status = rt.health_status()
    assert status.checks["engine"] and status.live
    assert not status.ready  # neither NATS nor etcd here

    def forward(*args, **kwargs):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(rt.engine.engine.model, "forward", forward)
    with pytest.raises(EngineDeadError):  # one failed step is all this engine takes
        async for _ in rt.engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=2)):
            pass
    await asyncio.wait_for(watch, 5)
    assert rt.exit_code == 1 and rt._stopped.is_set()
    status = rt.health_status()
    assert (status.live, status.ready, status.checks["engine"]) == (False, False, False)
    await rt.engine.shutdown()


async def test_a_normal_shutdown_is_not_a_death(tiny_model_dir):
    rt = runtime()
    rt.engine = await AsyncEngine.create(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=64))
    watch = asyncio.create_task(rt._watch_engine())
    rt._stopped.set()  # the signal came first
    await rt.engine.shutdown()
    await asyncio.wait_for(watch, 5)
    assert rt.exit_code == 0


async def test_a_worker_waiting_to_start_its_transfer_engine_keeps_its_loop_running(tmp_path, monkeypatch):
    """The transfer engine starts under this host's start lock (other workers' engines
    starting). The wait is off the event loop: /health answers and an identity slot's lease is
    kept meanwhile. On the loop, a lease of 5 s was lost while a worker waited (CI: a fifth
    compose replica got a live replica's identity)."""
    import ctypes
    import types

    import httpx

    from kvmesh.transfer import mooncake_agent
    from kvmesh.worker import runtime as runtime_module

    pool = ctypes.create_string_buffer(1 << 16)
    engine = types.SimpleNamespace(
        model_name="m", observe_steps=lambda metrics: None, is_alive=lambda: True, heartbeat_age=lambda: 0.0,
        kv_layout=types.SimpleNamespace(base_address=ctypes.addressof(pool), pool_bytes=len(pool)),
    )  # fmt: skip

    async def create_engine(settings):  # noqa: ANN001, ANN202 - the engine is not what is tested
        return engine

    monkeypatch.setattr(runtime_module, "create_engine", create_engine)
    monkeypatch.setattr(runtime_module.WorkerRuntime, "_watch_engine", lambda self: asyncio.sleep(3600))
    monkeypatch.setattr(mooncake_agent, "START_LOCK", tmp_path / "start.lock")
    rt = runtime()
    with mooncake_agent.one_start_at_a_time(tmp_path / "start.lock"):  # another worker's engine starting
        start = asyncio.create_task(rt.start())
        await asyncio.sleep(1)  # with the lock held (on the loop, the start would block it here for 30 s)
        assert getattr(rt, "agent", None) is None and not start.done()  # still waiting for the lock
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://127.0.0.1:{rt.health.port}/health/live", timeout=2)
        assert response.status_code == 200
    for _ in range(200):  # the lock let go: the engine starts
        if getattr(rt, "agent", None) is not None:
            break
        await asyncio.sleep(0.05)
    assert rt.agent.endpoint.startswith("127.0.0.1:")
    start.cancel()
    with contextlib.suppress(BaseException):
        await start
    for task in rt._background:
        task.cancel()
    await rt.health.stop()
