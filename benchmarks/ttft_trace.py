"""Where a first token's time goes in the mesh: `kvmesh up` with its spans exported (OTLP)
to a receiver here, random 128-token prompts at concurrency 1 (the serving benchmark's
`random-c1`), and per request the stages between the client's send and its first content
chunk, from the spans' timestamps (every process on this machine's one clock).

    .venv/bin/python benchmarks/ttft_trace.py --engine vllm --requests 16

Stages (p50 over the requests, ms): client send -> `mesh_request` starts in the router
(HTTP, parsing, validation); -> `prefill_call` starts (choosing workers: kv-metadata's
answer, the routing score); -> the worker's `prefill` span starts (publish, NATS, the
worker's decode of the request); -> the engine's first step (its queue wait); -> the
engine's output back on the worker's event loop (the step itself, vLLM's output path);
-> the reply leaves (pin, handle, encode); -> `prefill_call` ends (NATS, the router's
decode of the reply); -> the client's first chunk (SSE out, httpx in). Tracing itself costs
a little (each service's exporter thread): compare totals with `vllm_serving_bench.py`, not
with this script's TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_serving_bench as vsb  # noqa: E402

from kvmesh.testing.otlp_sink import OTLPSink, ReceivedSpan  # noqa: E402

logger = logging.getLogger("ttft_trace")


@dataclass(slots=True)
class Sent:
    request_id_hint: str
    sent_ns: int
    first_ns: int | None
    ttft_ms: float | None
    lines: list[tuple[float, str]] = field(default_factory=list)  # (ms after the send, the data line's start)


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], new_tokens: int) -> Sent:
    body = vsb.completion_body(model, prompt, new_tokens)
    sent = time.time_ns()
    started = time.perf_counter()
    first_ns = None
    ttft = None
    rid = ""
    lines = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line:
                lines.append((round(1e3 * (time.perf_counter() - started), 2), line[:90]))
            event = vsb.parse_sse_line(line)
            if not isinstance(event, dict):
                continue
            rid = rid or str(event.get("id", ""))
            if first_ns is None and vsb.event_text(event):
                first_ns = time.time_ns()
                ttft = 1e3 * (time.perf_counter() - started)
    return Sent(rid, sent, first_ns, ttft, lines)


STAGES = [
    ("client -> router mesh_request", "sent", "mesh_request.start"),
    ("routing (decode/prefill choice, kv-metadata)", "mesh_request.start", "prefill_call.start"),
    ("router publish -> worker prefill span", "prefill_call.start", "prefill.start"),
    ("worker: request -> engine scheduled (queue wait)", "prefill.start", "queue_wait.end"),
    ("worker: engine step + output to the loop", "queue_wait.end", "pin.start"),
    ("worker: pin, handle, reply sent", "pin.start", "prefill.end"),
    ("worker reply -> router has it", "prefill.end", "prefill_call.end"),
    ("router has reply -> client first chunk", "prefill_call.end", "first"),
]


def breakdown(sent: list[Sent], spans: list[ReceivedSpan]) -> dict[str, Any]:
    """Per request, each stage's ms; then p50 of each over the requests."""
    by_trace: dict[str, list[ReceivedSpan]] = {}
    for s in spans:
        by_trace.setdefault(s.trace_id, []).append(s)
    requests = [s for s in spans if s.name == "mesh_request"]
    rows = []
    for r in sorted(requests, key=lambda s: s.start):
        # the client request that sent it: the last one sent before the router's span began
        candidates = [x for x in sent if x.sent_ns <= r.start and x.first_ns is not None]
        if not candidates:
            continue
        client = max(candidates, key=lambda x: x.sent_ns)
        t: dict[str, int] = {"sent": client.sent_ns, "first": client.first_ns or 0}
        for s in by_trace[r.trace_id]:
            key = s.name
            if f"{key}.start" in t:  # the first of each (a retry would add more)
                continue
            t[f"{key}.start"], t[f"{key}.end"] = s.start, s.end
            for name, at in s.events:
                t.setdefault(f"{key}:{name}", at)
        if "queue_wait.end" not in t and "prefill.start" in t:
            t["queue_wait.end"] = t["prefill.start"]
        row: dict[str, Any] = {"ttft_ms": client.ttft_ms, "lines": client.lines[:4], "sent_ns": client.sent_ns}
        for label, a, b in STAGES:
            if a in t and b in t:
                row[label] = round((t[b] - t[a]) / 1e6, 2)
        row["events"] = {k: round((v - t["sent"]) / 1e6, 2) for k, v in sorted(t.items(), key=lambda kv: kv[1]) if k != "sent"}
        rows.append(row)
    summary = {}
    for label, _, _ in [("ttft_ms", "", ""), *STAGES]:
        values = [row[label] for row in rows if row.get(label) is not None]
        summary[label] = round(vsb.percentile(values, 0.5), 2) if values else None
    return {"rows": rows, "p50": summary}


async def in_process_ttft(engine: Any, prompt: list[int], new_tokens: int, rid: str) -> float:
    """The same prompt's first token from an engine in this process (ms): the worker's engine
    stage without the mesh around it."""
    from kvmesh.engine.request import SamplingParams

    started = time.perf_counter()
    first = None
    async for out in engine.generate(rid, prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True)):
        if out.new_token_ids and first is None:
            first = 1e3 * (time.perf_counter() - started)
    if first is None:  # read to the end, as the mesh's client does: no steps left running into the next request
        raise RuntimeError("no token")
    return first


async def measure(base_url: str, prompts: list[list[int]], new_tokens: int, engine: Any = None) -> tuple[list[Sent], list[float]]:
    """Each prompt through the mesh and, with ``engine``, in this process too (the order
    turning each prompt)."""
    model = vsb.served_model(base_url)
    out, local = [], []
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(120), trust_env=False) as client:
        for i, prompt in enumerate(prompts):
            if engine is not None and i % 2:
                local.append(await in_process_ttft(engine, prompt, new_tokens, f"local-{i}"))
            out.append(await one_request(client, model, prompt, new_tokens))
            if engine is not None and not i % 2:
                local.append(await in_process_ttft(engine, prompt, new_tokens, f"local-{i}"))
    return out, local


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["vllm", "kvmesh"], default="vllm")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=4, help="output tokens a request (the first is what is measured)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--extra-env", default="", help="KEY=VALUE,... for the mesh's services")
    p.add_argument("--up-args", default="", help="more arguments for `kvmesh up`, e.g. '--num-threads 2'")
    p.add_argument("--in-process-threads", type=int, default=0,
                   help="also each prompt on an engine in this process with this many threads (kvmesh engine only): "
                        "its TTFT beside the worker's engine stage")  # fmt: skip
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.in_process_threads and args.engine != "kvmesh":
        p.error("--in-process-threads: beside --engine kvmesh only (the engine in this process is kvmesh's)")
    args.vllm_python = args.vllm_python or vsb.default_vllm_python()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from kvmesh.engine.loader.default_model import resolve_model

    vocab = int(json.loads((resolve_model(None) / "config.json").read_text())["vocab_size"])
    sink = OTLPSink()
    os.environ |= {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    for pair in filter(None, args.extra_env.split(",")):
        key, _, value = pair.partition("=")
        os.environ[key] = value
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-ttft-trace-"))
    extra = [*(["--engine", "vllm"] if args.engine == "vllm" else []), *args.up_args.split()]
    before = vsb.machine_state()
    server = vsb.start_kvmesh_up(f"mesh-{args.engine}", args, workdir, extra)
    try:
        sent, local = asyncio.run(run_prompts(args, server.base_url, vocab))
        time.sleep(1.5)  # the exporters' last batches
    finally:
        server.stop()
        sink.close()
    result = breakdown(sent, sink.snapshot())
    result["machine_before"] = before
    result["engine"] = args.engine
    result["up_args"] = args.up_args
    if local:
        result["in_process_ttft_ms"] = local
        result["p50"]["in-process engine TTFT (same prompts)"] = round(vsb.percentile(local, 0.5), 2)
        engine_stage = "worker: engine step + output to the loop"
        prompt_of = {s.sent_ns: i for i, s in enumerate(sent)}  # a request breakdown skipped shifts no pair
        paired = [row[engine_stage] - local[prompt_of[row["sent_ns"]]] for row in result["rows"] if row.get(engine_stage) is not None]
        result["p50"]["worker's engine stage - in-process TTFT, paired"] = round(statistics.median(paired), 2) if paired else None
    for label, value in result["p50"].items():
        print(f"{value!s:>8}  {label}")
    middle = result["rows"][len(result["rows"]) // 2]
    print(json.dumps(middle["events"], indent=1))
    print(json.dumps(middle["lines"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


async def run_prompts(args: argparse.Namespace, base_url: str, vocab: int) -> tuple[list[Sent], list[float]]:
    engine = None
    if args.in_process_threads:
        from kvmesh.engine.async_engine import AsyncEngine
        from kvmesh.engine.llm_engine import EngineConfig

        config = EngineConfig(dtype=args.dtype, kv_cache_bytes=args.kv_cache_mib * 2**20, num_threads=args.in_process_threads)
        engine = await AsyncEngine.create(config)
    try:
        await measure(base_url, vsb.random_prompts(2, args.input_len, vocab, seed=999), args.new_tokens, engine)  # warm-up
        prompts = vsb.random_prompts(args.requests, args.input_len, vocab, seed=1000)
        return await measure(base_url, prompts, args.new_tokens, engine)
    finally:
        if engine is not None:
            await engine.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
