"""Compiling a native shared library into the kvmesh cache, once and atomically.

The bind guard (``kvmesh.transfer.bind_guard``) and the decode-attention kernel
(``kvmesh.engine.model.paged_kernel``) are both built with the system's compiler at
``make install`` or at first use. The compiler writes a temporary file beside the target,
which is renamed onto it only when the build succeeded: a process that finds the target
finds a whole library, and two processes building it at once are harmless. A library of
several sources compiles them as objects side by side, one a core (``compile_objects``),
before the link.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
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


def build_from_sources(
    path: Path,
    compile_argv: Callable[[Path, Path], list[str]],
    link_argv: Callable[[list[Path], str], list[str]],
    sources: Sequence[Path],
    *,
    timeout: float,
) -> str:
    """Compile ``sources`` into objects (``compile_argv(source, object)``, side by side, in a
    temporary folder beside ``path``), then link them into ``path`` (``link_argv(objects,
    output)``, as ``build_shared_library``): "" when it was built, else why not, in one line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=f".{path.stem}-objects-", dir=path.parent))
    except OSError as exc:
        return f"building {path} failed: {exc}"
    try:
        objects, failure = compile_objects(compile_argv, sources, folder, timeout=timeout)
        return failure or build_shared_library(path, lambda output: link_argv(objects, output), timeout=timeout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def compile_objects(argv: Callable[[Path, Path], list[str]], sources: Sequence[Path], folder: Path, *, timeout: float) -> tuple[list[Path], str]:
    """Compile each source with ``argv(source, object)`` into ``folder``, as many at once as
    this process has cores: the objects, and "" or why one failed, in one line."""
    jobs = max(1, len(os.sched_getaffinity(0)))
    objects = [folder / f"{i}-{source.stem}.o" for i, source in enumerate(sources)]
    running: list[tuple[subprocess.Popen[str], str]] = []  # each compile, and its compiler for its failure line
    try:
        for source, target in zip(sources, objects):
            if len(running) == jobs:
                failure = _finish(*running[0], timeout)
                running.pop(0)
                if failure:
                    return objects, failure
            command = argv(source, target)
            try:
                running.append((subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), command[0]))
            except OSError as exc:
                return objects, f"{command[0]} failed to start: {exc}"
        while running:
            failure = _finish(*running[0], timeout)
            running.pop(0)
            if failure:
                return objects, failure
    finally:
        for process, _ in running:  # after a failure or an interruption: none left running
            process.kill()
            process.communicate()
    return objects, ""


def _finish(process: subprocess.Popen[str], compiler: str, timeout: float) -> str:
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return f"{compiler} took more than {timeout:g} s"
    return f"{compiler} failed: {' '.join(stderr.split())[:300]}" if process.returncode else ""
