"""What a request's HTTP span costs the router on the way to a stream's first chunk: its own
``HttpSpans`` (as the router runs since 45a753a) against OpenTelemetry's FastAPI
instrumentation (as it ran before: FastAPI's own telemetry on, the instrumentation installed
as ``services/router/main.py`` did), side by side in one process.

Both apps are the router's (``create_app``) over a backend that answers at once with one
finished token, with the router's tracer provider (spans recorded, none exported). Each
request is a streamed completion of a 128-token prompt driven straight through the ASGI
interface (no socket, no HTTP parsing), timed from the call to the first body chunk. The two
apps alternate, request by request; the paired difference is each pair's. Two modes: back to
back ("hot": the interpreter's caches and branch predictors warm) and with an idle gap before
each request (``--gap-ms``, as a router waits through a prefill: "cold").

The instrumentation is no longer a dependency: ``pip install opentelemetry-instrumentation-fastapi``
(constraints.txt before 45a753a pinned 0.66b2) to run this.

    .venv/bin/python benchmarks/router_spans_bench.py --requests 2000 --cold-requests 300 --json /tmp/spans.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from router_http_bench import InstantBackend  # noqa: E402

from kvmesh.machine import cpu_flags, cpu_model  # noqa: E402

logger = logging.getLogger("router_spans_bench")

BODY = json.dumps({"model": "bench", "prompt": list(range(100, 228)), "max_tokens": 1, "temperature": 0, "stream": True}).encode()
HEADERS = [
    (b"host", b"127.0.0.1:8000"),
    (b"accept", b"*/*"),
    (b"accept-encoding", b"gzip, deflate"),
    (b"connection", b"keep-alive"),
    (b"user-agent", b"python-httpx/0.28.1"),
    (b"content-length", str(len(BODY)).encode()),
    (b"content-type", b"application/json"),
]


def apps() -> dict[str, Any]:
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    from kvmesh.services.router.app import create_app
    from kvmesh.services.router.http_spans import HttpSpans
    from kvmesh.telemetry import setup_tracing

    setup_tracing("kvmesh-router")
    spans = create_app(InstantBackend())  # type: ignore[arg-type]
    before = create_app(InstantBackend())  # type: ignore[arg-type]
    before.user_middleware = [m for m in before.user_middleware if m.cls is not HttpSpans]
    before._native_telemetry.config.update(tracing=True, metrics=True, logs=True, operation_spans=True)  # FastAPI's defaults
    FastAPIInstrumentor.instrument_app(before, excluded_urls="health,metrics", exclude_spans=["send", "receive"])
    return {"http_spans": spans, "fastapi_instrumentation": before}


async def first_chunk_us(app: Any) -> float:
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 40000), "scheme": "http", "method": "POST", "root_path": "", "path": "/v1/completions",
        "raw_path": b"/v1/completions", "query_string": b"", "headers": HEADERS, "state": {},
    }  # fmt: skip
    answered = asyncio.Event()
    body_sent = False
    first = 0
    started = time.perf_counter_ns()

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal first
        if message["type"] == "http.response.body" and message.get("body") and not first:
            first = time.perf_counter_ns()

    await app(scope, receive, send)
    answered.set()
    assert first, "no body chunk"
    return (first - started) / 1e3


async def run(requests: int, gap: float, warmup: int = 100) -> dict[str, Any]:
    servers = apps()
    for _ in range(warmup):
        for app in servers.values():
            await first_chunk_us(app)
    times: dict[str, list[float]] = {name: [] for name in servers}
    names = list(servers)
    for i in range(requests):
        for name in names if i % 2 else names[::-1]:
            if gap:
                await asyncio.sleep(gap)
            times[name].append(await first_chunk_us(servers[name]))
    paired = [b - s for s, b in zip(times["http_spans"], times["fastapi_instrumentation"], strict=True)]
    return {
        "gap_ms": gap * 1e3,
        "requests": requests,
        "p50_us": {name: statistics.median(values) for name, values in times.items()},
        "instrumentation_less_spans_paired_p50_us": statistics.median(paired),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="pairs back to back")
    parser.add_argument("--cold-requests", type=int, default=300, help="pairs with an idle gap before each request")
    parser.add_argument("--gap-ms", type=float, default=50.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = [asyncio.run(run(args.requests, 0.0)), asyncio.run(run(args.cold_requests, args.gap_ms / 1e3))]
    machine = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "python": platform.python_version()}
    print(f"Machine: {machine['cpu']} ({machine['cpu_flags']}), {machine['cores']} cores; command: {' '.join(sys.argv)}")
    print("| mode | HttpSpans: first chunk p50 (µs) | FastAPI instrumentation: p50 (µs) | instrumentation less HttpSpans, paired p50 (µs) |")
    print("|---|---:|---:|---:|")
    for result in results:
        mode = f"idle {result['gap_ms']:.0f} ms before each" if result["gap_ms"] else "back to back"
        p50 = result["p50_us"]
        print(
            f"| {mode} ({result['requests']} pairs) | {p50['http_spans']:.0f} | {p50['fastapi_instrumentation']:.0f} "
            f"| {result['instrumentation_less_spans_paired_p50_us']:+.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "command": sys.argv, "results": results}, indent=2))


if __name__ == "__main__":
    main()
