"""Run by tests/worker/test_vllm_stats.py with .venv-vllm's python: vLLM's own stats objects
(``vllm.v1.metrics.stats``, its real dataclasses) through kvmesh's stat logger into a
worker's real ``WorkerMetrics``, next to the outputs kvmesh's step observer is told of.
Prints the registry's Prometheus text after a line ``--metrics--``."""

from __future__ import annotations

import sys
import types

from prometheus_client import generate_latest
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, PrefixCacheStats, SchedulerStats

from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.request import FinishReason as KvmeshFinish
from kvmesh.metrics.worker import WorkerMetrics
from kvmesh.worker.vllm_stats import VllmStats


def iteration(preempted: int = 0, finished: tuple[FinishedRequestStats, ...] = ()) -> IterationStats:
    stats = IterationStats()
    stats.num_preempted_reqs = preempted
    stats.finished_requests = list(finished)
    return stats


def main() -> None:
    stats = VllmStats()
    logger_class = stats.stat_logger_class()
    ours = logger_class(None, [0])
    manager = types.SimpleNamespace(stat_loggers=[object(), ours, object()])  # vLLM's own two and ours
    assert stats.keep_only_ours(types.SimpleNamespace(logger_manager=manager))
    assert manager.stat_loggers == [ours]
    other = VllmStats()
    assert not other.keep_only_ours(types.SimpleNamespace(logger_manager=types.SimpleNamespace(stat_loggers=[ours])))
    assert not other.keep_only_ours(types.SimpleNamespace(logger_manager=None))  # disable_log_stats
    late = WorkerMetrics("m", "decode", "w2")
    other.observe(late)  # stats off: the worker keeps timing the phases itself
    assert other.observer is None and not late._engine_phases
    metrics = WorkerMetrics("m", "decode", "w1")
    stats.observe(metrics)  # as VllmEngine.observe_steps does

    scheduler = SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25, prefix_cache_stats=PrefixCacheStats())
    # Two requests arrive; a step makes their first tokens and preempts one of them twice over two steps.
    for rid in ("a", "b"):
        metrics.arrived(rid)
    first = [RequestOutput(rid, [7], "x", False, None, 40, 32) for rid in ("a", "b")]
    ours.record(scheduler, iteration(preempted=1))
    metrics.stepped(first, 0.01, stats.num_preemptions)
    ours.record(scheduler, iteration(preempted=1))
    metrics.stepped([], 0.01, stats.num_preemptions)
    ours.record(scheduler, None)  # a step with no outputs: vLLM hands scheduler stats alone
    done = FinishedRequestStats(
        FinishReason.LENGTH, "a", e2e_latency=2.0, num_prompt_tokens=40, queued_time=0.125, prefill_time=0.5, decode_time=1.25
    )
    failed = FinishedRequestStats(FinishReason.ERROR, "b", queued_time=9.0, prefill_time=9.0, decode_time=9.0)
    ours.record(scheduler, iteration(finished=(done, failed)))
    metrics.stepped(
        [
            RequestOutput("a", [8], "y", True, KvmeshFinish.LENGTH, 40, 32),
            RequestOutput("b", [], "", True, KvmeshFinish.ERROR, 40, 32),
        ],
        0.01,
        stats.num_preemptions,
    )
    print(f"preemptions={stats.num_preemptions}")
    print("--metrics--")
    sys.stdout.write(generate_latest(metrics.registry).decode())


if __name__ == "__main__":
    main()
