"""Running a script with the vLLM virtualenv's Python (``.venv-vllm``, or
``KVMESH_VLLM_PYTHON``) and this tree's kvmesh: how the tests of the parts that import vLLM
run them. Skips the test where there is no such virtualenv."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvmesh.worker.engines import worker_python

SHARED = Path(__file__).resolve().parents[2] / "shared"


def run_in_vllm_venv(args: list[str], *, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python *args`` in the vLLM virtualenv, vLLM's own ``VLLM_*`` settings cleared; the
    test fails with the end of its stderr unless it exits 0."""
    try:
        python = worker_python("vllm")
    except ValueError as exc:
        pytest.skip(f"no vLLM virtualenv ({exc})")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SHARED), str(SHARED.parent), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([python, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done
