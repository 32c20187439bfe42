"""A worker whose engine dies stops serving and exits non-zero (so a supervisor restarts
it), and its health checks say so meanwhile; never a live process with a dead engine."""

from __future__ import annotations

import asyncio

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
