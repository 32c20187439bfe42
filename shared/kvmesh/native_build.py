"""Compiling a native shared library into the kvmesh cache, once and atomically.

The bind guard (``kvmesh.transfer.bind_guard``) and the decode-attention kernel
(``kvmesh.engine.model.paged_kernel``) are both built with the system's compiler at
``make install`` or at first use. The compiler writes a temporary file beside the target,
which is renamed onto it only when the build succeeded: a process that finds the target
finds a whole library, and two processes building it at once are harmless.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_shared_library(path: Path, argv: Callable[[str], list[str]], *, timeout: float, mode: int | None = None) -> str:
    """Run ``argv(output)`` to compile into ``path``: "" when it was built, else why not,
    in one line. ``output`` is a temporary file beside ``path``, renamed onto it at the end."""
    compiler = argv("")[0]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=path.suffix, dir=path.parent)
        os.close(fd)
        try:
            result = subprocess.run(argv(temporary), capture_output=True, text=True, timeout=timeout)
            if result.returncode != 0:
                return f"{compiler} failed: {' '.join(result.stderr.split())[:300]}"
            if mode is not None:
                os.chmod(temporary, mode)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"building {path} failed: {exc}"
    return ""
