"""The engines a worker can host, by name (``--engine``), behind
``kvmesh.worker.engine_api.Engine``.

``kvmesh`` is kvmesh's own PyTorch engine (``kvmesh.worker.kvmesh_engine``). ``vllm`` is
reserved for the vLLM worker (issue 9) and refused with a clear reason. Free of torch until
an engine is created: settings check the name here.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.worker.engine_api import Engine
    from kvmesh.worker.settings import WorkerSettings

ENGINES = ("kvmesh", "vllm")


def unavailable(name: str) -> str | None:
    """Why a worker cannot host the engine ``name`` here (``None``: it can)."""
    if name == "kvmesh":
        return None
    if name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return "--engine vllm: vLLM is not installed in this environment (and kvmesh does not host it yet)"
        return "--engine vllm: kvmesh does not host vLLM yet (issue 9); use --engine kvmesh"
    return f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}"


async def create_engine(settings: WorkerSettings) -> Engine:
    """Load the engine ``settings.engine`` names (off the event loop) and start it."""
    reason = unavailable(settings.engine)
    if reason is not None:
        raise ValueError(reason)
    from kvmesh.worker.kvmesh_engine import KvmeshEngine

    return await KvmeshEngine.start(settings)
