"""The floor under the mesh's first-token path: what the named packages cost on their own.

The mesh's "TTFT added" (``mesh_bench.py``: a streamed completion's time to first token
through `kvmesh up` less the same engine's in-process) is, once the worker's engine is taken
out, the path around it: HTTP in, the router, a NATS message to the prefill worker, its hand-off
to its engine thread and back, a NATS message back, the first SSE chunk out. This runs, in one
run, interleaved request by request, that path three ways:

- ``asgi``: the least the shape allows: a bare ASGI app on uvicorn (h11, as the router is
  served) that parses the body with pydantic, sends one NATS request (TLS, as the mesh's
  NATS is) to a worker and streams the answer's first chunk; the worker is nats-py and
  kvmesh's ``AsyncEngine`` (the same engine, model and threads as a `kvmesh up` worker), and
  answers as the engine's first token comes.
- ``fastapi``: the same with the route a FastAPI one (the body a pydantic parameter, the
  answer a ``StreamingResponse``), as kvmesh's router is written.
- ``kvmesh``: `kvmesh up` from this tree (1 prefill + 1 decode worker), everything it does.

``--http h11,httptools`` adds both floors on uvicorn's httptools parser (``asgi-httptools``,
``fastapi-httptools``), where httptools is installed (it is not a dependency).

Each side's path is its client's TTFT (a plain socket, ``mesh_bench.SocketClient``) less its
worker's engine time for that request: every worker times its engine alike, from the request's
arrival at the engine to the end of the step that made its first token (kvmesh's worker as its
``kvmesh:time_to_first_token_seconds``, the floors' through the same ``StepObserver`` calls),
so the hand-offs to and from the engine's thread are in every side's path.

Before that, the three routers' apps alone, in this process, driven through ASGI over a first
token that is there at once (kvmesh's: ``create_app`` over ``router_http_bench.InstantBackend``),
back to back and with an idle gap before each request (as a router waits through a prefill).

    .venv/bin/python benchmarks/path_floor_bench.py --requests 60 --json docs/benchmarks-path-floor.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parent))

logger = logging.getLogger("path_floor_bench")

FLOORS = ("asgi", "fastapi")


class Completion(BaseModel):
    """The floors' request body (at module level: FastAPI resolves a route's annotations by name)."""

    model: str
    prompt: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    ignore_eos: bool = False
    stream: bool = False


# ----------------------------------------------------------------------------- the floors' processes
class FirstTokenTiming:
    """A request's engine time to its first token, timed where a kvmesh worker's metrics time
    ``kvmesh:time_to_first_token_seconds`` (``kvmesh.metrics.worker``): from its arrival at the
    engine to the end of the step that made the token."""

    def __init__(self) -> None:
        self.arrival: dict[str, float] = {}
        self.ttft: dict[str, float] = {}

    def arrived(self, request_id: str) -> None:
        self.arrival[request_id] = time.monotonic()

    def imported(self, output: Any) -> None:
        pass

    def stepped(self, outputs: list[Any], seconds: float, preemptions: int) -> None:
        now = time.monotonic()
        for out in outputs:
            if out.new_token_ids and out.request_id in self.arrival:
                self.ttft[out.request_id] = now - self.arrival.pop(out.request_id)

    def closed(self, request_id: str) -> None:
        self.arrival.pop(request_id, None)


def floor_worker(subject: str, nats_url: str, ca: str, threads: int, dtype: str, ready: Any) -> None:
    """nats-py and kvmesh's engine: a request's prompt in, its first token's id and the engine's
    time to it out."""
    import nats

    from kvmesh.engine.async_engine import AsyncEngine
    from kvmesh.engine.llm_engine import EngineConfig
    from kvmesh.engine.request import SamplingParams
    from kvmesh.security.tls import client_context

    async def main() -> None:
        engine = await AsyncEngine.create(EngineConfig(dtype=dtype, kv_cache_bytes=256 * 2**20, num_threads=threads))
        timing = FirstTokenTiming()
        engine.observe_steps(timing)
        nc = await nats.connect(nats_url, tls=client_context(ca), tls_handshake_first=True)
        count = 0

        async def prefill(msg: Any) -> None:
            nonlocal count
            count += 1
            request_id = f"f{count}"
            prompt = json.loads(msg.data)["prompt"]
            async for out in engine.generate(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True)):
                if out.new_token_ids:
                    answer = {"token": out.new_token_ids[0], "engine_s": timing.ttft.pop(request_id)}
                    await nc.publish(msg.reply, json.dumps(answer).encode())
                    break

        await nc.subscribe(subject, cb=prefill)
        await nc.flush()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def floor_apps(first_token: Callable[[Completion], Awaitable[str]], engine_s: Callable[[], float], started: Callable[[], Awaitable[None]]) -> dict[str, Any]:
    """The two floors' apps: ``/v1/completions`` answers with the SSE chunk ``first_token``
    makes and ``[DONE]``; ``/engine_total`` with ``engine_s()``; ``started`` runs at startup."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    async def bare(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await started()
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/engine_total":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": json.dumps(engine_s()).encode()})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        chunk = await first_token(Completion.model_validate_json(body))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await started()
        yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Completion) -> StreamingResponse:
        chunk = await first_token(request)

        async def chunks() -> AsyncIterator[str]:
            yield chunk
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/engine_total")
    async def engine_total() -> JSONResponse:
        return JSONResponse(engine_s())

    return {"asgi": bare, "fastapi": app}


def sse_chunk(token: int) -> str:
    return f"data: {json.dumps({'object': 'text_completion', 'choices': [{'index': 0, 'text': str(token)}]})}\n\n"


def floor_router(kind: str, subject: str, nats_url: str, ca: str, port: int, http: str, ready: Any) -> None:
    """uvicorn serving a floor's app with the HTTP implementation ``http`` (``h11``, as the
    router is served, or ``httptools``), its first token asked of its worker over NATS (TLS)."""
    import nats
    import uvicorn

    from kvmesh.security.tls import client_context

    state: dict[str, Any] = {"engine_s": 0.0}

    async def connect() -> None:
        state["nc"] = await nats.connect(nats_url, tls=client_context(ca), tls_handshake_first=True)
        ready.set()

    async def first_token(request: Completion) -> str:
        reply = await state["nc"].request(subject, json.dumps({"prompt": request.prompt}).encode(), timeout=60)
        answer = json.loads(reply.data)
        state["engine_s"] += answer["engine_s"]
        return sse_chunk(answer["token"])

    app = floor_apps(first_token, lambda: state["engine_s"], connect)[kind]
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http=http, loop="asyncio")


# ----------------------------------------------------------------------------- the apps alone
async def app_costs(requests: int, gap: float, warmup: int = 100) -> dict[str, Any]:
    """Each app's time from an ASGI request to its first body chunk, in this process, over a
    first token that is there at once: the router's own app (``create_app`` over
    ``router_http_bench.InstantBackend``) and the two floors' apps, taking turns request by
    request, ``gap`` seconds idle before each."""
    from router_http_bench import InstantBackend
    from router_spans_bench import first_chunk_us

    from kvmesh.services.router.app import create_app

    async def instant(request: Completion) -> str:
        return sse_chunk(7)

    async def nothing() -> None:
        pass

    apps = {"kvmesh": create_app(InstantBackend()), **floor_apps(instant, lambda: 0.0, nothing)}  # type: ignore[arg-type]
    names = list(apps)
    for _ in range(warmup):
        for app in apps.values():
            await first_chunk_us(app)
    times: dict[str, list[float]] = {name: [] for name in names}
    for number in range(requests):
        turn = number % len(names)
        for name in names[turn:] + names[:turn]:
            if gap:
                await asyncio.sleep(gap)
            times[name].append(await first_chunk_us(apps[name]))
    return {"gap_ms": gap * 1e3, "requests": requests, "p50_us": {name: statistics.median(values) for name, values in times.items()}}


# ----------------------------------------------------------------------------- the paths
async def run(args: argparse.Namespace) -> dict[str, Any]:
    from mesh_bench import SocketClient, prompts_for, start_up, worker_metrics_url, worker_ttft_total

    from kvmesh.engine.loader.default_model import resolve_model
    from kvmesh.engine.tokenizer import Tokenizer
    from kvmesh.infra.processes import free_port
    from kvmesh.infra.servers import start_nats
    from kvmesh.security.tls import MeshTLS

    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-floor-"))
    tls = MeshTLS.generate(workdir / "tls", {"nats": ["127.0.0.1", "localhost"]})
    nats_server = start_nats(workdir / "nats", tls=tls)
    ctx = mp.get_context("spawn")
    processes: list[Any] = []
    mesh = None
    urls: dict[str, str] = {}
    # a floor per app and HTTP implementation: "asgi", "fastapi" on h11, "asgi-httptools", ...
    floors = {kind if http == "h11" else f"{kind}-{http}": (kind, http) for http in args.http for kind in FLOORS}
    try:
        for name, (kind, http) in floors.items():
            worker_ready, router_ready = ctx.Event(), ctx.Event()
            port = free_port()
            ca = str(nats_server.tls_ca)
            subject = f"floor.{name}"  # each floor its own worker
            processes.append(ctx.Process(target=floor_worker, args=(subject, nats_server.address, ca, args.threads, args.dtype, worker_ready), daemon=True))
            processes[-1].start()
            processes.append(ctx.Process(target=floor_router, args=(kind, subject, nats_server.address, ca, port, http, router_ready), daemon=True))
            processes[-1].start()
            if not (worker_ready.wait(300) and router_ready.wait(60)):
                raise RuntimeError(f"the {name} floor did not start")
            urls[name] = f"http://127.0.0.1:{port}"
        mesh = await asyncio.to_thread(start_up, argparse.Namespace(dtype=args.dtype, threads=args.threads), workdir, "mesh")
        urls["kvmesh"] = mesh.base_url
        engine_urls = {name: f"{urls[name]}/engine_total" for name in floors}
        engine_urls["kvmesh"] = worker_metrics_url(mesh.workdir / "mesh") or ""
        if not engine_urls["kvmesh"]:
            raise RuntimeError("no metrics URL in the prefill worker's log")

        sides = [*floors, "kvmesh"]
        tokenizer = Tokenizer.from_dir(resolve_model(None))
        prompts = prompts_for(tokenizer, len(sides) * (args.requests + args.warmup), args.prompt_tokens)
        clients = {side: SocketClient(urls[side]) for side in sides}
        paths: dict[str, list[float]] = {side: [] for side in sides}
        ttfts: dict[str, list[float]] = {side: [] for side in sides}
        async with httpx.AsyncClient(timeout=30) as scraper:

            async def engine_total(side: str) -> float:
                if side == "kvmesh":
                    return await worker_ttft_total(scraper, engine_urls[side])
                response = await scraper.get(engine_urls[side])
                response.raise_for_status()
                return float(response.json())

            index = 0
            for number in range(args.warmup + args.requests):
                turn = number % len(sides)
                for side in sides[turn:] + sides[:turn]:
                    before = await engine_total(side)
                    ttft, _ = await clients[side].completion(prompts[index], 1)
                    index += 1  # a fresh prompt every time: no side's prefix cache helps
                    engine_s = await engine_total(side) - before
                    if number >= args.warmup:
                        ttfts[side].append(ttft * 1e3)
                        paths[side].append((ttft - engine_s) * 1e3)
        for client in clients.values():
            await client.close()
    finally:
        if mesh is not None:
            await asyncio.to_thread(mesh.stop)
        for process in processes:
            process.kill()
        nats_server.stop()
    return {
        side: {
            "path_p50_ms": statistics.median(paths[side]),
            "path_mean_ms": statistics.mean(paths[side]),
            "path_p10_ms": sorted(paths[side])[len(paths[side]) // 10],
            "path_p90_ms": sorted(paths[side])[9 * len(paths[side]) // 10],
            "ttft_p50_ms": statistics.median(ttfts[side]),
            "requests": len(paths[side]),
            "path_ms": [round(p, 3) for p in paths[side]],
            # each request's path through kvmesh less the one before or after it here: same moment
            "kvmesh_less_this_paired_p50_ms": statistics.median(k - p for k, p in zip(paths["kvmesh"], paths[side], strict=True)),
        }
        for side in paths
    }


def machine() -> dict[str, Any]:
    import torch

    from kvmesh.machine import cpu_flags, cpu_model

    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


def idle_mode(gap_ms: float) -> str:
    return f"idle {gap_ms:.0f} ms before each" if gap_ms else "back to back"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40, help="per side")
    parser.add_argument("--warmup", type=int, default=3, help="per side, not counted")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads per engine")
    parser.add_argument("--app-requests", type=int, default=2000, help="the apps alone: requests per app back to back")
    parser.add_argument("--app-cold-requests", type=int, default=300, help="the apps alone: requests per app after an idle gap")
    parser.add_argument("--gap-ms", type=float, default=50.0, help="the idle gap")
    parser.add_argument("--http", default="h11", type=lambda text: text.split(","),
                        help="the floors' uvicorn HTTP implementations, comma-separated: h11, httptools (if importable; "
                             "the router's is h11 either way)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="the results as JSON")
    args = parser.parse_args()
    if set(args.http) - {"h11", "httptools"}:
        parser.error(f"--http: h11 or httptools, not {args.http}")
    if "httptools" in args.http:
        import httptools  # noqa: F401 - a clear error here rather than in a child

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    apps = [asyncio.run(app_costs(args.app_requests, 0.0)), asyncio.run(app_costs(args.app_cold_requests, args.gap_ms / 1e3))]
    results = asyncio.run(run(args))
    meta = machine()
    lines = [
        f"Path floor, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, `{' '.join(sys.argv)}`",
        f"Machine: {meta['cpu']} ({meta['cpu_flags']}), {meta['cores']} cores, Python {meta['python']}, torch {meta['torch']}",
        "",
        "| side | path p50 (ms) | p10 | p90 | mean | kvmesh less this, paired p50 (ms) | TTFT p50 (ms) | requests |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {side} | {r['path_p50_ms']:.2f} | {r['path_p10_ms']:.2f} | {r['path_p90_ms']:.2f} | {r['path_mean_ms']:.2f} "
            f"| {r['kvmesh_less_this_paired_p50_ms']:.2f} | {r['ttft_p50_ms']:.1f} | {r['requests']} |"
            for side, r in results.items()
        ),
        "",
        "| the apps alone, ASGI request to first chunk | kvmesh's router (µs) | FastAPI route (µs) | bare ASGI (µs) |",
        "|---|---:|---:|---:|",
        *(
            f"| {idle_mode(a['gap_ms'])} ({a['requests']} each) "
            f"| {a['p50_us']['kvmesh']:.0f} | {a['p50_us']['fastapi']:.0f} | {a['p50_us']['asgi']:.0f} |"
            for a in apps
        ),
    ]
    print("\n".join(lines))
    if args.json:
        report = {"machine": meta, "command": " ".join(sys.argv), "at": datetime.now(UTC).isoformat(), "results": results, "apps": apps}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
