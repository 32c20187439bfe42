"""``benchmarks/path_floor_bench.py``'s parts: the floors' apps and the router's answer a
streamed completion with a first chunk, and its engine timing takes the points a kvmesh
worker's ``kvmesh:time_to_first_token_seconds`` takes, on a real engine."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import path_floor_bench  # noqa: E402

import mesh_bench  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402

from kvmesh.engine.async_engine import AsyncEngine  # noqa: E402
from kvmesh.engine.llm_engine import EngineConfig  # noqa: E402
from kvmesh.engine.request import SamplingParams  # noqa: E402
from kvmesh.metrics.worker import WorkerMetrics  # noqa: E402


async def test_every_app_answers_a_stream_with_its_first_chunk() -> None:
    result = await path_floor_bench.app_costs(requests=3, gap=0.001, warmup=1)
    assert result["requests"] == 3 and result["gap_ms"] == 1.0
    assert set(result["p50_us"]) == {"kvmesh", "asgi", "fastapi"}
    assert all(p50 > 0 for p50 in result["p50_us"].values())


class Both:
    """Tells two step observers of everything (an engine takes one)."""

    def __init__(self, *observers: Any) -> None:
        self.observers = observers

    def __getattr__(self, name: str) -> Any:
        return lambda *args: [getattr(observer, name)(*args) for observer in self.observers]


async def test_the_floors_engine_time_is_timed_where_a_workers_metrics_time_it(tiny_model_dir: Path) -> None:
    timing = path_floor_bench.FirstTokenTiming()
    metrics = WorkerMetrics("m", "prefill", "prefill-1")
    config = EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=64)
    async with await AsyncEngine.create(config) as engine:
        engine.observe_steps(Both(timing, metrics))  # type: ignore[arg-type]
        async for out in engine.generate("r1", [5, 6, 7, 8, 9], SamplingParams(max_tokens=1, ignore_eos=True)):
            assert out.new_token_ids
    assert set(timing.ttft) == {"r1"} and not timing.arrival  # nothing left behind
    worker_ttft = mesh_bench.ttft_total(generate_latest(metrics.registry).decode())
    assert 0 < timing.ttft["r1"] < 30
    assert abs(timing.ttft["r1"] - worker_ttft) < 0.005  # the same two moments, give or take a call
