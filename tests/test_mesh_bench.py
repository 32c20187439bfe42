"""``benchmarks/mesh_bench.py``'s split of a mesh request's TTFT: the prefill worker's metrics
URL from its log under `kvmesh up`, and its summed time to first token from its real metrics."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import mesh_bench  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402

from kvmesh.metrics.worker import WorkerMetrics  # noqa: E402


def test_the_worker_metrics_url_is_read_from_its_log(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    line = "2026-12-07 13:38:13,260 INFO kvmesh.worker.health [trace=- span=-]: health checks on http://127.0.0.1:33109/health/live and /health/ready\n"
    (tmp_path / "logs" / "prefill-1.log").write_text("starting\n" + line)
    assert mesh_bench.worker_metrics_url(tmp_path) == "http://127.0.0.1:33109/metrics"
    assert mesh_bench.worker_metrics_url(tmp_path, "prefill-2") is None


def test_the_ttft_total_sums_the_workers_histogram() -> None:
    metrics = WorkerMetrics("m", "prefill", "prefill-1")
    assert mesh_bench.ttft_total(generate_latest(metrics.registry).decode()) == 0.0
    metrics.ttft.observe(0.25)
    metrics.ttft.observe(0.5)
    assert mesh_bench.ttft_total(generate_latest(metrics.registry).decode()) == 0.75
