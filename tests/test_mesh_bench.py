"""``benchmarks/mesh_bench.py``'s split of a mesh request's TTFT: the prefill worker's metrics
URL from its log under `kvmesh up`, and its summed time to first token from its real metrics;
and its plain-socket client against the router's real HTTP server."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

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


async def test_the_socket_client_reads_a_stream_and_keeps_its_connection(tiny_model_dir: Path) -> None:
    from kvmesh.engine.tokenizer import Tokenizer
    from kvmesh.services.router.app import create_app
    from kvmesh.services.router.limits import Limits
    from tests.router.fakes import Emit, FakeBackend, Finish, Sleep
    from tests.router.served import served

    # an empty text (an incomplete character) is not a token the client has seen yet
    script = [Emit((5,), ""), Sleep(0.05), Emit((6,), "Hi"), Sleep(0.1), Emit((7,), " there"), Finish("length")]
    backend = FakeBackend(Tokenizer.from_dir(tiny_model_dir), script=script, model_name=mesh_bench.MODEL)
    async with served(create_app(backend), Limits()) as router:
        client = mesh_bench.SocketClient(router.url)
        try:
            for _ in range(2):  # the second request goes on the same connection
                ttft, gaps = await client.completion([1, 2, 3], 3)
                assert 0.05 <= ttft < 1.0
                assert len(gaps) == 1 and 0.1 <= gaps[0] < 1.0
            assert len(router.server.server_state.connections) == 1
            # the router closes a connection idle for its keep-alive timeout: a new one, then
            for connection in list(router.server.server_state.connections):
                connection.transport.close()
            await asyncio.sleep(0.1)
            ttft, _ = await client.completion([1, 2, 3], 3)
            assert 0.05 <= ttft < 1.0
            backend.model_name = "another-model"  # a 404 is an error, not a hang
            with pytest.raises(RuntimeError, match="404"):
                await client.completion([1, 2, 3], 3)
        finally:
            await client.close()
