"""benchmarks/router_http_bench.py serves the router's app, a bare ASGI floor, the app
without OpenTelemetry, the app tokenizing off its loop and the app from a baseline checkout,
in processes of their own, and times both clients against each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "router_http_bench.py"


def test_every_server_and_client_is_timed_and_the_router_answers_for_real(tmp_path) -> None:
    out = tmp_path / "router-http.json"
    done = subprocess.run(
        # this checkout as its own baseline (a second router from another tree's Python), an idle moment before each request
        [sys.executable, str(BENCH), "--requests", "3", "--rounds", "1", "--gap-ms", "5", "--baseline-tree", str(BENCH.parents[1]), "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["cpu"]
    rows = report["results"]
    servers = ("floor", "router", "router-no-otel", "router-off-loop", "router (baseline)")
    assert set(rows) == {f"{server} ({client})" for server in servers for client in ("socket", "httpx")}
    for row in rows.values():
        for mode in ("stream", "json"):
            assert row[mode]["n"] == 3 and row[mode]["p50_ms"] > 0
    assert "| router (socket) |" in done.stderr  # the table, against the floor of its client
