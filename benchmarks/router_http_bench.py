"""What the router's HTTP edge costs a request, apart from the mesh (issue 12's TTFT overhead).

The router's app (``create_app``) is served by the router's own server (``RouterServer``:
uvicorn with the router's protocol) in a process of its own, over a backend that answers at
once: one finished token event per request, no NATS, no engine. A client in this process
sends chat completions one after the other on one keep-alive connection (a plain socket,
so the client's own cost stays small and equal for every server) and times each from the
request's first byte to the first SSE ``data:`` chunk (streamed) or the whole answer (not
streamed). Side by side in one run, rounds interleaved:

- ``floor``: a bare ASGI app under the same server that reads the body and writes a canned
  answer: what uvicorn and the socket cost;
- ``router``: the router's app as ``kvmesh up`` serves it (its spans recorded, as the router
  records them, with no exporter);
- ``router-no-otel``: the same with no tracer provider (spans not recorded);
- ``router-off-loop``: the router with every prompt tokenized in its thread pool (as before
  small bodies were tokenized on the event loop);
- ``router (baseline)``, with ``--baseline-tree DIR``: the router as another checkout serves
  it (the code before a change), in the same run.

``--gap-ms`` leaves the servers idle before each request, as a router is while a prefill runs
(Python's work after an idle moment costs about twice its hot-loop time on some CPUs).

    .venv/bin/python benchmarks/router_http_bench.py --requests 300 --rounds 3 --json /tmp/router-http.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("router_http_bench")

SERVERS = ("floor", "router", "router-no-otel", "router-off-loop")
MODEL = "bench"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say something about the sea and the sky."}], "max_tokens": 1}


# --------------------------------------------------------------------------- the servers
class InstantBackend:
    """A ``GenerationBackend`` that answers every request at once with one finished token."""

    model_name = MODEL
    max_model_len = 2048

    def __init__(self) -> None:
        from kvmesh.engine.loader.default_model import resolve_model
        from kvmesh.engine.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_dir(resolve_model(None))

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: Any, *, session_id: str | None = None) -> AsyncIterator[Any]:
        from kvmesh.protocol import TokenEvent

        yield TokenEvent(
            request_id=request_id, seq=0, token_ids=[42], text=" Hi", finished=True, finish_reason="length",
            num_prompt_tokens=len(prompt_token_ids),
        )

    async def health(self) -> Any:
        from kvmesh.services.router.backend import HealthReport

        return HealthReport(ready=True, workers={"decode": 1})


class FloorApp:
    """A bare ASGI app: reads the body, writes a canned SSE answer (``state`` as the server needs)."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        from kvmesh.services.router.shutdown import Shutdown

        self.state = SimpleNamespace(shutdown=Shutdown())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await _floor_answer(receive, send)


async def _floor_answer(receive: Any, send: Any) -> None:
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if json.loads(body).get("stream"):
        answer, kind = b'data: {"choices":[{"index":0,"delta":{"content":" Hi"}}]}\n\ndata: [DONE]\n\n', b"text/event-stream"
        headers = [(b"content-type", kind)]
    else:
        answer = b'{"choices":[{"index":0,"message":{"role":"assistant","content":" Hi"}}]}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def _serve(kind: str, port_out: Any) -> None:
    """A server process: ``kind``'s app on a free loopback port (sent back on ``port_out``)."""
    logging.basicConfig(level=logging.WARNING)
    from kvmesh.services.router.app import create_app
    from kvmesh.services.router.limits import Limits
    from kvmesh.services.router.server import RouterServer, bind, serve

    limits = Limits()
    if kind == "floor":
        app: Any = FloorApp()
    else:
        inline = {"router-off-loop": -1}.get(kind)
        app = create_app(InstantBackend(), limits=limits, **({} if inline is None else {"inline_tokenize_bytes": inline}))  # type: ignore[arg-type]
        if kind in ("router", "router-off-loop"):
            from kvmesh.telemetry import setup_tracing

            setup_tracing("kvmesh-router")  # as the router: spans recorded (exported only with an OTLP endpoint set)
    sock = bind("127.0.0.1", 0)
    port_out.send(sock.getsockname()[1])
    asyncio.run(serve(RouterServer(app, limits), sock))


def _serve_baseline(tree: Path) -> tuple[Any, int]:
    """The router as ``tree`` (another checkout: the code before a change) serves it, in a
    process of its own: ``tree``'s Python and ``kvmesh`` (``shared/kvmesh/services`` linked
    to its ``services``, as ``mesh_bench.py --baseline-tree`` needs), this file's server."""
    here = str(Path(__file__).resolve().parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import router_http_bench as b; b._serve_printing('router')"
    env = {**os.environ, "PYTHONPATH": str(tree / "shared")}
    proc = subprocess.Popen([str(tree / ".venv" / "bin" / "python"), "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.strip().isdigit():
        proc.kill()
        raise RuntimeError(f"the baseline router from {tree} did not start: {line!r}")
    return proc, int(line)


def _serve_printing(kind: str) -> None:
    """``_serve``, its port printed on stdout."""

    class Out:
        def send(self, port: int) -> None:
            print(port, flush=True)

    _serve(kind, Out())


# --------------------------------------------------------------------------- the client
def _request(port: int, stream: bool) -> bytes:
    body = json.dumps({**CHAT, "stream": stream}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _read_answer(conn: socket.socket, stream: bool) -> float:
    """Reads one answer; the time its first data (streamed) or its end (not) arrived."""
    buf = b""
    first = 0.0
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        buf += chunk
        if len(buf) >= 12 and not buf.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the server answered {buf[:200]!r}")
        if stream and not first and b"data:" in buf:
            first = time.perf_counter()
        if stream and b"[DONE]" in buf and buf.endswith(b"0\r\n\r\n"):  # chunked encoding's last chunk
            return first
        if not stream and b"\r\n\r\n" in buf:
            head, _, rest = buf.partition(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            if len(rest) >= length:
                return time.perf_counter()


def measure(port: int, requests: int, stream: bool, warmup: int = 20, gap: float = 0.0) -> list[float]:
    """Latencies (ms) of ``requests`` sequential requests on one keep-alive connection,
    ``gap`` seconds idle before each (as a router waits through a prefill)."""
    request = _request(port, stream)
    out: list[float] = []
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(warmup + requests):
            if gap:
                time.sleep(gap)
            t0 = time.perf_counter()
            conn.sendall(request)
            t1 = _read_answer(conn, stream)
            if i >= warmup:
                out.append((t1 - t0) * 1e3)
    return out


def measure_httpx(port: int, requests: int, stream: bool, warmup: int = 20, gap: float = 0.0) -> list[float]:
    """The same with httpx's AsyncClient, as ``mesh_bench.py`` sends its requests: what a
    common Python client adds on the client's side."""
    import httpx

    async def run() -> list[float]:
        out: list[float] = []
        payload = {**CHAT, "stream": stream}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for i in range(warmup + requests):
                if gap:
                    await asyncio.sleep(gap)
                t0 = time.perf_counter()
                if stream:
                    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
                        response.raise_for_status()
                        t1 = 0.0
                        async for line in response.aiter_lines():
                            if line.startswith("data:") and not t1:
                                t1 = time.perf_counter()
                else:
                    (await client.post("/v1/chat/completions", json=payload)).raise_for_status()
                    t1 = time.perf_counter()
                if i >= warmup:
                    out.append((t1 - t0) * 1e3)
        return out

    return asyncio.run(run())


def _wait_listening(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _cpu() -> str:
    """The CPU's model and its vector extensions."""
    try:
        from kvmesh.machine import cpu_flags, cpu_model

        return f"{cpu_model()} ({cpu_flags()})"
    except Exception:  # pragma: no cover - informative only
        return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per server per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--clients", default="socket,httpx", help="socket (a plain keep-alive socket), httpx (its AsyncClient)")
    parser.add_argument("--gap-ms", type=float, default=0.0, help="idle before each request (a router waits through a prefill)")
    parser.add_argument("--baseline-tree", type=Path, help="also the router as this checkout serves it: router (baseline)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kinds = [k for k in args.servers.split(",") if k]
    ctx = mp.get_context("spawn")
    procs: dict[str, tuple[Any, int]] = {}
    try:
        for kind in kinds:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(kind, child), daemon=True)
            proc.start()
            procs[kind] = (proc, parent.recv())
        if args.baseline_tree:
            kinds.append("router (baseline)")
            procs["router (baseline)"] = _serve_baseline(args.baseline_tree)
        for _, port in procs.values():
            _wait_listening(port)
        clients = {"socket": measure, "httpx": measure_httpx}
        wanted = [c for c in args.clients.split(",") if c]
        samples: dict[str, dict[str, list[float]]] = {
            f"{k} ({c})": {"stream": [], "json": []} for c in wanted for k in kinds
        }
        for r in range(args.rounds):
            order = kinds if r % 2 == 0 else list(reversed(kinds))
            for client in wanted:
                for kind in order:
                    for mode in ("stream", "json"):
                        samples[f"{kind} ({client})"][mode] += clients[client](procs[kind][1], args.requests, mode == "stream", gap=args.gap_ms / 1e3)
        results = {
            kind: {
                mode: {"p50_ms": round(statistics.median(v), 3), "p90_ms": round(statistics.quantiles(v, n=10)[-1], 3), "n": len(v)}
                for mode, v in by_mode.items()
            }
            for kind, by_mode in samples.items()
        }
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.join(5) if hasattr(proc, "join") else proc.wait(5)
    report = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "load_before": os.getloadavg()},
        "results": results,
    }
    logger.info("%s", json.dumps(report, indent=2))
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def print_table(results: dict[str, Any]) -> None:
    logger.info("| server (client) | streamed: first chunk p50 (ms) | added to floor | not streamed: answer p50 (ms) | added to floor |")
    logger.info("|---|---:|---:|---:|---:|")
    for kind, r in results.items():
        floor = results.get(f"floor ({kind.rsplit('(', 1)[-1]}")
        s, j = r["stream"]["p50_ms"], r["json"]["p50_ms"]
        ds = f"{s - floor['stream']['p50_ms']:+.2f}" if floor else "—"
        dj = f"{j - floor['json']['p50_ms']:+.2f}" if floor else "—"
        logger.info("| %s | %.2f | %s | %.2f | %s |", kind, s, ds, j, dj)


if __name__ == "__main__":
    main()
