"""A vLLM worker refuses structured output by name (kvmesh's grammar is not passed to vLLM yet):
the request fails with a 400-class error instead of an answer that ignores the grammar."""

from __future__ import annotations

import pytest

from kvmesh.engine.request import SamplingParams
from kvmesh.engine.structured import GuidedDecoding
from kvmesh.worker.vllm_core import VllmCore


def test_a_vllm_worker_refuses_a_grammar_by_name() -> None:
    core = object.__new__(VllmCore)  # no vLLM needed: the refusal comes before it is imported
    with pytest.raises(ValueError, match=r"structured output \(response_format, guided_\*"):
        core.sampling(SamplingParams(guided=GuidedDecoding("json_object")))
