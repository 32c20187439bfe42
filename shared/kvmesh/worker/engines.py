"""The engines a worker can host, by name (``--engine``), behind
``kvmesh.worker.engine_api.Engine``.

``kvmesh`` is kvmesh's own PyTorch engine (``kvmesh.worker.kvmesh_engine``); ``vllm`` is
vLLM (``kvmesh.worker.vllm_engine``, imported only when asked for). vLLM lives in a
virtualenv of its own (``make vllm`` builds ``.venv-vllm``: its pins conflict with the
router's), so a launcher (``kvmesh up``) starts vLLM workers with that virtualenv's Python:
``worker_python``. Free of torch until an engine is created: settings check the name here.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.settings.env import VLLM_PYTHON

if TYPE_CHECKING:
    from kvmesh.worker.engine_api import Engine
    from kvmesh.settings.worker import EngineSettings

ENGINES = ("kvmesh", "vllm")
# The module of each engine: importing it imports torch (seconds, more on a busy machine).
ENGINE_MODULES = {"kvmesh": "kvmesh.worker.kvmesh_engine", "vllm": "kvmesh.worker.vllm_engine"}
DEFAULT_BLOCK_SIZE = {"kvmesh": 16, "vllm": 32}  # tokens per KV block; vLLM on CPU takes multiples of 32


def unavailable(name: str) -> str | None:
    """Why this process cannot host the engine ``name`` (``None``: it can)."""
    if name == "kvmesh":
        return None
    if name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return (
                f"--engine vllm: vLLM is not installed for {sys.executable}; "
                "`make vllm` builds .venv-vllm, run vLLM workers with .venv-vllm/bin/python"
            )
        return None
    return f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}"


def block_size_problem(name: str, device: str, block_size: int) -> str | None:
    """Why the engine ``name`` on ``device`` cannot have KV blocks of ``block_size`` tokens
    (``None``: it can): said at start, not by vLLM after the model has loaded."""
    if name == "vllm" and device == "cpu" and block_size % 32:
        return f"--block-size {block_size}: vLLM on CPU takes a multiple of 32"
    return None


def tensor_parallel(size: int | None, engine_args: str | None) -> int:
    """The worker processes vLLM splits the model across: ``--tensor-parallel-size``, or
    ``--engine-args``' ``tensor_parallel_size`` (a JSON object, checked before), applied last."""
    extra = json.loads(engine_args) if engine_args else {}
    if not isinstance(extra, dict):
        raise ValueError("--engine-args: must be a JSON object of EngineArgs fields")
    value = extra.get("tensor_parallel_size", size or 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"--engine-args: tensor_parallel_size must be a positive whole number, not {value!r}")
    return value


def parallel_problem(s: EngineSettings) -> str | None:
    """Why a worker cannot host ``s``' parallel engine (``None``: it can). vLLM with
    tensor parallel keeps its KV pool in its worker processes, split by heads, shared with
    the worker's (``kvmesh.worker.shared_pool``): on the CPU only, so far; its ranks bound to
    their cores, it lends none. Pipeline parallel is refused: vLLM 0.32's CPU backend fails it at start, so it has
    not run here."""
    problem = engine_args_problem(s.engine_args) if s.engine_args is not None else None
    if problem is not None:
        return problem
    if json.loads(s.engine_args or "{}").get("pipeline_parallel_size", 1) != 1:
        return "pipeline parallel: not run by kvmesh's workers yet (vLLM's CPU backend fails it); use --tensor-parallel-size"
    try:
        ranks = tensor_parallel(s.tensor_parallel_size, s.engine_args)
    except ValueError as exc:
        return str(exc)
    if ranks == 1:
        return None
    if s.name != "vllm":
        return f"--tensor-parallel-size {ranks}: vLLM's workers only (--engine vllm)"
    if s.device != "cpu":  # a GPU rank's pool is device memory: the transfer engine would have to run in each rank
        return f"--tensor-parallel-size {ranks} on {s.device}: kvmesh shares vLLM's ranks' KV pools on the CPU only yet"
    if s.lend_cores is not None:
        return f"--tensor-parallel-size {ranks}: its processes are bound to their cores; not with --lend-cores"
    return None


def engine_args_problem(text: str) -> str | None:
    """Why ``--engine-args`` cannot be ``text`` (``None``: it can): a JSON object of vLLM's
    ``EngineArgs`` fields, said by the worker's settings and by ``kvmesh up``."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"--engine-args: not JSON ({exc})"
    return None if isinstance(value, dict) else "--engine-args: must be a JSON object of EngineArgs fields"


def worker_python(name: str) -> str:
    """The Python a launcher starts workers hosting ``name`` with: this one where it can host
    the engine, else for vLLM ``$KVMESH_VLLM_PYTHON`` or the repository's ``.venv-vllm``.
    Raises ``ValueError`` saying why there is none."""
    if unavailable(name) is None:
        return sys.executable
    if name != "vllm":
        raise ValueError(unavailable(name))
    configured = VLLM_PYTHON.raw()
    candidate = Path(configured) if configured else _repo_vllm_python()
    if candidate is not None and os.access(candidate, os.X_OK):
        return str(candidate)
    where = f"{VLLM_PYTHON.name}={configured} is not an executable" if configured else "no .venv-vllm beside kvmesh"
    raise ValueError(f"--engine vllm: vLLM is not installed for {sys.executable} and {where}; run `make vllm`")


def _repo_vllm_python() -> Path | None:
    """``.venv-vllm/bin/python`` in the repository kvmesh runs from (an editable install's)."""
    root = Path(__file__).resolve().parents[3]  # shared/kvmesh/worker/engines.py
    candidate = root / ".venv-vllm" / "bin" / "python"
    return candidate if candidate.exists() else None


def preload(name: str) -> None:
    """Import the module of the engine ``name`` (and with it torch). Done before a worker
    claims its identity slot, off the event loop: an import on the loop held it for seconds,
    and on a busy machine the slot's lease (5 s) ran out meanwhile and another replica took
    the identity."""
    importlib.import_module(ENGINE_MODULES[name])


async def create_engine(settings: EngineSettings) -> Engine:
    """Load the engine ``settings.name`` names (off the event loop) and start it."""
    reason = unavailable(settings.name)
    if reason is not None:
        raise ValueError(reason)
    await asyncio.to_thread(preload, settings.name)  # the imports below find the module loaded
    if settings.name == "vllm":
        from kvmesh.worker.vllm_engine import VllmEngine

        return await VllmEngine.start(settings)
    from kvmesh.worker.kvmesh_engine import KvmeshEngine

    return await KvmeshEngine.start(settings)
