"""The KV cache layout kvmesh's vLLM connector asks for: layers inside blocks off CPU (a run
of blocks is one Mooncake read), nothing on CPU. Run in a process of the vLLM virtualenv
(``vllm_connector_story.py``), against vLLM's own layout names."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvmesh.worker.engines import worker_python

SHARED = Path(__file__).resolve().parents[2] / "shared"
STORY = Path(__file__).with_name("vllm_connector_story.py")


@pytest.mark.vllm
def test_the_connector_asks_for_layers_inside_blocks_off_cpu_and_nothing_on_cpu():
    try:
        python = worker_python("vllm")
    except ValueError as exc:
        pytest.skip(f"no vLLM virtualenv ({exc})")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SHARED), str(SHARED.parent), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([python, str(STORY)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
