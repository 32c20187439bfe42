"""The KV cache layout kvmesh's vLLM connector asks for: layers inside blocks off CPU (a run
of blocks is one Mooncake read), nothing on CPU, against vLLM's own layout names; and what
its worker side (in each tensor-parallel rank) reports from each step's metadata. Run in a
process of the vLLM virtualenv (``vllm_connector_story.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.vllm_venv import run_in_vllm_venv

STORY = Path(__file__).with_name("vllm_connector_story.py")


@pytest.mark.vllm
def test_the_connectors_layout_and_its_reports_from_each_steps_metadata():
    done = run_in_vllm_venv([str(STORY)])
    assert done.stdout.strip().endswith("ok")
