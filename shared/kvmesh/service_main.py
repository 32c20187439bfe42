"""How every service process starts (``start_service``), waits for its signal
(``until_signalled``), runs its ``main`` and exits (``run_service``).

After a service has closed its connections, flushed its spans and logged its last line,
the interpreter's own teardown (unmapping torch and the KV pool, finalizers) costs ~0.7 s
of CPU per process, which is most of a local mesh's stop time on two cores. Nothing is
left to clean up by then, so the process exits at once with the service's exit code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NoReturn, TypeVar

from kvmesh.errors import KvmeshError
from kvmesh.telemetry import log_settings, masked, setup_logging, setup_tracing

S = TypeVar("S")

_service_process = False


def running_as_service() -> bool:
    """Is this process a service run by ``run_service`` (its own process, which it may
    execute again, as a worker does to preload the bind guard), not a test calling a main?"""
    return _service_process


def run_service(main: Coroutine[Any, Any, int | None], prog: str) -> NoReturn:
    """Runs a service's ``main`` as its process and exits with its code. What kvmesh refuses
    on purpose (``KvmeshError``: a model that is not there, a port it cannot listen on, a KV
    pool that holds no block) ends the process with one line, ``prog: error: ...``, and exit
    code 1, not a traceback; Ctrl-C before the service has its signal handlers ends it
    quietly (130)."""
    global _service_process
    _service_process = True
    try:
        code = asyncio.run(main) or 0
    except KvmeshError as exc:
        logging.getLogger("kvmesh").debug("%s stopped", prog, exc_info=exc)
        sys.stderr.write(f"{prog}: error: {exc}\n")
        code = 1
    except KeyboardInterrupt:
        code = 130
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def settings_values(settings: Any, prefix: str = "") -> dict[str, object]:
    """A settings dataclass as ``name: value``, nested ones flattened (``mesh.nats_url``),
    each value masked by its own name where it is a secret; fields whose metadata says
    ``logged: False`` left out."""
    values: dict[str, object] = {}
    for f in dataclasses.fields(settings):
        if not f.metadata.get("logged", True):
            continue
        value = getattr(settings, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            values |= settings_values(value, f"{prefix}{f.name}.")
        else:
            values[prefix + f.name] = masked(f.name, value)
    return values


async def start_service(
    service: str, settings: S, *, instance: str | None = None, prepare: Callable[[], Awaitable[S]] | None = None
) -> S:
    """What every service does first: its logging; ``prepare``, what must come first and
    gives the settings to run with (a worker's: its bind guard, which may execute the
    process again, so that the settings are logged once); the resolved settings logged once
    (secrets masked); its tracer provider (``kvmesh-<service>``, spaces as dashes), whose
    instance id is the settings' field ``instance`` names. Returns the settings."""
    setup_logging()
    if prepare is not None:
        settings = await prepare()
    log_settings(service, settings_values(settings))
    setup_tracing(f"kvmesh-{service.replace(' ', '-')}", getattr(settings, instance) if instance else None)
    return settings


async def until_signalled(stop: asyncio.Event | None = None) -> None:
    """Until SIGTERM or SIGINT, or until ``stop`` is set by something else (an engine that
    died, say): the signals set ``stop``."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
