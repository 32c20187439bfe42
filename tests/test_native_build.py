"""``kvmesh.native_build``: a library is renamed into place only when it compiled."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from kvmesh.native_build import build_shared_library, compile_objects

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


def _object_argv(source: Path, target: Path) -> list[str]:
    return [str(CC), "-c", "-fPIC", str(source), "-o", str(target)]


def test_sources_compile_to_objects_side_by_side_and_link_into_one_library(tmp_path: Path) -> None:
    sources = []
    for i in range(5):  # more than the cores here: some wait for a free one
        sources.append(tmp_path / f"part{i}.c")
        sources[-1].write_text(f"int kvmesh_part{i}(void) {{ return {i * 10}; }}\n")
    (tmp_path / "objects").mkdir()
    objects, failure = compile_objects(_object_argv, sources, tmp_path / "objects", timeout=60)
    assert failure == "" and all(o.exists() for o in objects)
    target = tmp_path / "parts.so"
    assert build_shared_library(target, lambda output: [str(CC), "-shared", *map(str, objects), "-o", output], timeout=60) == ""
    library = ctypes.CDLL(str(target))
    assert [getattr(library, f"kvmesh_part{i}")() for i in range(5)] == [0, 10, 20, 30, 40]


def test_one_source_that_does_not_compile_fails_the_objects_in_one_line(tmp_path: Path) -> None:
    good, broken = tmp_path / "good.c", tmp_path / "broken.c"
    good.write_text("int kvmesh_good(void) { return 1; }\n")
    broken.write_text("int kvmesh_broken(void) { return }\n")
    _, failure = compile_objects(_object_argv, [good, broken, good], tmp_path, timeout=60)
    assert failure.startswith(f"{CC} failed:") and "\n" not in failure and "error" in failure
    _, failure = compile_objects(lambda source, target: ["/nonexistent/cc", str(source)], [good], tmp_path, timeout=5)
    assert failure.startswith("/nonexistent/cc failed to start:")
