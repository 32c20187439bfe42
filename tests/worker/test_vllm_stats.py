"""vLLM's own stats in a worker's metrics (``kvmesh.worker.vllm_stats``): vLLM's real
``IterationStats`` / ``FinishedRequestStats`` / ``SchedulerStats``, recorded through
kvmesh's stat logger as ``LLMEngine.step`` records them, give a real ``WorkerMetrics`` vLLM's
preemptions and its queue / prefill / decode times (and only those: the worker's own timing
of those phases stops, a failed request is left out), beside the tokens and TTFT counted
from the outputs. Run in a process of the vLLM virtualenv (``vllm_stats_story.py``)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.worker.vllm_stats import RequestPhases, phases_of
from tests.worker.vllm_venv import run_in_vllm_venv

STORY = Path(__file__).with_name("vllm_stats_story.py")


def test_phases_of_a_finished_request_and_none_for_a_failed_one():
    finished = types.SimpleNamespace(finish_reason=1, queued_time=0.25, prefill_time=0.5, decode_time=-1e-9)
    assert phases_of(finished) == RequestPhases(0.25, 0.5, 0.0)  # clock noise never gives a negative time
    assert phases_of(types.SimpleNamespace(finish_reason=3, queued_time=1, prefill_time=1, decode_time=1)) is None


@pytest.mark.vllm
def test_vllms_stats_objects_feed_preemptions_and_request_phases():
    done = run_in_vllm_venv([str(STORY)])
    head, _, text = done.stdout.partition("--metrics--\n")
    assert "preemptions=2" in head
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["kvmesh:num_preemptions_total"] == 2
    # vLLM's times of request "a" alone ("b" failed), observed once each: not the worker's own timing too
    for name, seconds in (("queue", 0.125), ("prefill", 0.5), ("decode", 1.25)):
        assert samples[f"kvmesh:request_{name}_time_seconds_count"] == 1, name
        assert samples[f"kvmesh:request_{name}_time_seconds_sum"] == pytest.approx(seconds), name
    # what the outputs say is counted as before: two prompts, three tokens, two first tokens, one success
    assert samples["kvmesh:prompt_tokens_total"] == 80 and samples["kvmesh:generation_tokens_total"] == 3
    assert (samples["kvmesh:prefix_cache_queries_total"], samples["kvmesh:prefix_cache_hits_total"]) == (80, 64)
    assert samples["kvmesh:time_to_first_token_seconds_count"] == 2
    assert samples["kvmesh:e2e_request_latency_seconds_count"] == 1
