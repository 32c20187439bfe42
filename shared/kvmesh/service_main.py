"""How every service process runs its ``main`` and exits.

After a service has closed its connections, flushed its spans and logged its last line,
the interpreter's own teardown (unmapping torch and the KV pool, finalizers) costs ~0.7 s
of CPU per process, which is most of a local mesh's stop time on two cores. Nothing is
left to clean up by then, so the process exits at once with the service's exit code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Coroutine
from typing import Any, NoReturn


_service_process = False


def running_as_service() -> bool:
    """Is this process a service run by ``run_service`` (its own process, which it may
    execute again, as a worker does to preload the bind guard), not a test calling a main?"""
    return _service_process


def run_service(main: Coroutine[Any, Any, int | None]) -> NoReturn:
    global _service_process
    _service_process = True
    code = asyncio.run(main) or 0
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
