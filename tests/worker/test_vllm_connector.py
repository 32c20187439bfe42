"""The KV cache layout kvmesh's vLLM connector asks for: layers inside blocks off CPU (a run
of blocks is one Mooncake read), nothing on CPU. Run in a process of the vLLM virtualenv
(``vllm_connector_story.py``), against vLLM's own layout names."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.vllm_venv import run_in_vllm_venv

STORY = Path(__file__).with_name("vllm_connector_story.py")


@pytest.mark.vllm
def test_the_connector_asks_for_layers_inside_blocks_off_cpu_and_nothing_on_cpu():
    done = run_in_vllm_venv([str(STORY)])
    assert done.stdout.strip().endswith("ok")
