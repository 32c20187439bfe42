"""``kvmesh.native_build``: a library is renamed into place only when it compiled."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from kvmesh.native_build import build_shared_library

CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")


def _argv(source: Path):
    return lambda output: [str(CC), "-shared", "-fPIC", "-o", output, str(source)]


def test_a_library_that_compiles_is_built_in_place_with_no_temporary_left(tmp_path: Path) -> None:
    source = tmp_path / "answer.c"
    source.write_text("int kvmesh_answer(void) { return 42; }\n")
    target = tmp_path / "cache" / "answer.so"
    assert build_shared_library(target, _argv(source), timeout=60, mode=0o755) == ""
    assert ctypes.CDLL(str(target)).kvmesh_answer() == 42
    assert target.stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in target.parent.iterdir()) == ["answer.so"]


def test_a_failed_compile_leaves_no_target_and_says_why_in_one_line(tmp_path: Path) -> None:
    source = tmp_path / "broken.c"
    source.write_text("int kvmesh_broken(void) { return }\n")
    target = tmp_path / "broken.so"
    failure = build_shared_library(target, _argv(source), timeout=60)
    assert failure.startswith(f"{CC} failed:") and "\n" not in failure and "error" in failure
    assert list(tmp_path.iterdir()) == [source]


def test_a_missing_compiler_is_a_failure_line_not_an_exception(tmp_path: Path) -> None:
    failure = build_shared_library(tmp_path / "x.so", lambda output: ["/nonexistent/cc", "-o", output], timeout=5)
    assert failure.startswith(f"building {tmp_path / 'x.so'} failed:")
    assert list(tmp_path.iterdir()) == []
