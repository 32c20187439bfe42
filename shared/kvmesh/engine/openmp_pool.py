"""Ending an idle engine thread's OpenMP helper threads at once.

libgomp (torch's OpenMP runtime, which the engine's compiled kernels share) keeps a thread's
helpers spinning after each parallel region before they sleep: 300,000 rounds, about 8 ms on
an AMD EPYC Zen 3 (docs/benchmarks.md, "An idle engine's OpenMP helpers spin 8 ms"). After
an engine's last step before it waits for work, that spin holds a core while the step's
tokens travel: the worker's event loop, NATS, the router and the client share what is left.
``release_helpers`` ends the calling thread's helpers (OpenMP 5's
``omp_pause_resource_all``, soft); its next parallel region starts new ones, which costs what
waking sleeping ones does. Only for a thread whose helpers nothing has bound to cores (vLLM
binds its own: its engine keeps them).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1


@functools.cache
def _pause_functions() -> tuple[Callable[[int], int], ...]:
    """``omp_pause_resource_all`` of every libgomp this process has loaded (none off Linux);
    first called after torch has run, from the engine thread."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ()
    paths = sorted({line.split(maxsplit=5)[5] for line in maps.splitlines() if "/libgomp" in line})
    functions: list[Callable[[int], int]] = []
    for path in paths:
        try:
            function = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_pause_resource_all
        except (OSError, AttributeError) as exc:  # not loaded after all, or an OpenMP before 5.0
            logger.debug("no omp_pause_resource_all in %s: %s", path, exc)
            continue
        function.argtypes = [ctypes.c_int]
        function.restype = ctypes.c_int
        functions.append(function)
    return tuple(functions)


def release_helpers() -> bool:
    """End the calling thread's idle OpenMP helpers now, not after their spin; False where
    there is no libgomp to ask (or it refused: inside a parallel region)."""
    functions = _pause_functions()
    return bool(functions) and all(function(OMP_PAUSE_SOFT) == 0 for function in functions)
