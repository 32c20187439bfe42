"""Mesh benchmarks, each side by side in one run.

1. KV transfer: the Mooncake transfer engine (tcp, loopback) against a raw loopback socket
   copy of the same bytes, GB/s, for a range of sizes; and coalesced block runs against
   one range per block.
2. Latency at low load: time to first token and inter-token latency through the mesh
   (`kvmesh up` from this tree, in a process of its own: router -> prefill worker -> KV
   pulled -> decode worker -> SSE) against the same engine
   in-process, sequential requests, interleaved rounds. "Added" is reported two ways: the
   difference of the two sides' p50s, and the median of the paired differences (each
   prompt goes to both sides back to back, so the pair shares the machine's state; less
   noisy). With ``--baseline-tree DIR`` a second mesh, `kvmesh up` from another checkout
   (the code before a change; it needs `.venv` and `shared/kvmesh/services` linked as
   `vllm_interleaved_bench.py --baseline-tree` says), is up at the same time and takes
   every prompt too, the order of the three sides turning from prompt to prompt. Each
   mesh request is also split in two: the prefill worker's own time to first token (its
   engine, from the request's arrival at the engine to the step that made the token: its
   ``kvmesh:time_to_first_token_seconds`` read from its ``/metrics`` before and after) and
   the path around it (the mesh's TTFT less that: HTTP, the router, NATS both ways, the
   worker's hand-offs to and from its engine thread, which the in-process engine pays too).
   Every mesh takes every prompt twice: through httpx's ``AsyncClient`` (as Python clients
   send) and through a plain socket (``SocketClient``), whose own cost is small: the two
   differ by what a client library spends on its side, which is not the mesh's.

    .venv/bin/python benchmarks/mesh_bench.py --markdown docs/benchmarks-mesh.md
    .venv/bin/python benchmarks/mesh_bench.py --sizes-mib 1 --transfer-rounds 1 --requests 20 \
        --baseline-tree /work/wt-base
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, UTC
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.llm_engine import EngineConfig
from kvmesh.engine.own_thread import call_in_own_thread
from kvmesh.engine.request import SamplingParams
from kvmesh.machine import cpu_flags, cpu_model
from kvmesh.transfer.mooncake_agent import MooncakeAgent
from kvmesh.transfer.runs import BlockRun

logger = logging.getLogger("mesh_bench")

MODEL = "SmolLM2-135M-Instruct"


# ----------------------------------------------------------------------------- transfer
def socket_copy(nbytes: int, src: torch.Tensor, dst: torch.Tensor) -> float:
    """Seconds to send ``nbytes`` from src to dst over a loopback TCP connection."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    src_view = memoryview(src.numpy()).cast("B")[:nbytes]
    dst_view = memoryview(dst.numpy()).cast("B")[:nbytes]

    def send() -> None:
        conn, _ = server.accept()
        conn.sendall(src_view)
        conn.close()

    sender = threading.Thread(target=send)
    sender.start()
    client = socket.create_connection(("127.0.0.1", port))
    started = time.perf_counter()
    received = 0
    while received < nbytes:
        count = client.recv_into(dst_view[received:], nbytes - received)
        if count == 0:
            raise RuntimeError("socket closed early")
        received += count
    seconds = time.perf_counter() - started
    client.close()
    sender.join()
    server.close()
    return seconds


def transfer_bench(sizes_mib: list[int], rounds: int, block_bytes: int) -> list[dict]:
    largest = max(sizes_mib) * 2**20
    src = torch.randint(0, 255, (largest,), dtype=torch.uint8)
    dst = torch.zeros(largest, dtype=torch.uint8)
    peer, local = MooncakeAgent(), MooncakeAgent()
    peer.register(src.data_ptr(), largest)
    local.register(dst.data_ptr(), largest)
    rows = []
    for mib in sizes_mib:
        nbytes = mib * 2**20
        blocks = nbytes // block_bytes
        one_run = [BlockRun(0, 0, blocks)]
        per_block = [BlockRun(i, i, 1) for i in range(blocks)]
        layout = dict(peer_base=src.data_ptr(), local_base=dst.data_ptr(), block_bytes=block_bytes)
        local.read_blocks(peer.endpoint, one_run, **layout)  # warm-up (connection set-up)
        socket_copy(nbytes, src, dst)
        mooncake, mooncake_blocks, sock = [], [], []
        for _ in range(rounds):
            dst.zero_()
            mooncake.append(local.read_blocks(peer.endpoint, one_run, **layout).seconds)
            assert torch.equal(dst[: blocks * block_bytes], src[: blocks * block_bytes])
            mooncake_blocks.append(local.read_blocks(peer.endpoint, per_block, **layout).seconds)
            sock.append(socket_copy(blocks * block_bytes, src, dst))
        moved = blocks * block_bytes
        rows.append(
            {
                "mib": mib,
                "blocks": blocks,
                "mooncake_gbps": moved / statistics.median(mooncake) / 1e9,
                "mooncake_per_block_gbps": moved / statistics.median(mooncake_blocks) / 1e9,
                "socket_gbps": moved / statistics.median(sock) / 1e9,
            }
        )
        logger.info("transfer %s", rows[-1])
    return rows


# ----------------------------------------------------------------------------- latency
def prompts_for(tokenizer, count: int, length: int) -> list[list[int]]:
    text = "The river valley has farms, old stone bridges, markets and quiet roads through the hills. " * 40
    base = tokenizer.encode(text)
    return [[(t + 7 * i) % 49000 + 100 for t in base[:length]] for i in range(count)]


async def in_process(engine: AsyncEngine, prompt: list[int], new_tokens: int, rid: str) -> tuple[float, list[float]]:
    started = time.perf_counter()
    times = []
    async for out in engine.generate(rid, prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True)):
        if out.new_token_ids:
            times.append(time.perf_counter())
    return times[0] - started, [b - a for a, b in zip(times, times[1:])]


async def through_mesh(client: httpx.AsyncClient, prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    times = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0]["text"]:
                    times.append(time.perf_counter())
    return times[0] - started, [b - a for a, b in zip(times, times[1:])]


class SocketClient:
    """Streamed completions over one kept-alive HTTP/1.1 connection with no HTTP library: the
    request's bytes are built before its clock starts, the answer is de-chunked and split into
    SSE events by hand. Its own cost is small (httpx's ``AsyncClient`` costs about 1.7 ms a
    request on the client's side: docs/benchmarks.md, "The router's HTTP edge"), so its time to
    first token is what the mesh adds, not what a Python HTTP library does with the answer."""

    def __init__(self, base_url: str) -> None:
        host, _, port = base_url.removeprefix("http://").rstrip("/").partition(":")
        self.host, self.port = host, int(port)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
            self._reader = self._writer = None

    def request_bytes(self, prompt: list[int], new_tokens: int) -> bytes:
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True}).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        return head.encode() + body

    async def _connected(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The open connection, or a new one: the router closes one idle for 5 s (uvicorn's
        keep-alive timeout), as it may be between two requests of a mesh's client here."""
        if self._reader is None or self._writer is None or self._reader.at_eof() or self._writer.is_closing():
            await self.close()
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            self._writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._reader, self._writer

    async def completion(self, prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
        """The time to the first event with text, and the gaps between events with text; a
        connection is opened before the clock starts."""
        request = self.request_bytes(prompt, new_tokens)
        for last_try in (False, True):
            reader, writer = await self._connected()
            started = time.perf_counter()
            writer.write(request)
            try:
                head = await reader.readuntil(b"\r\n\r\n")
                break
            except asyncio.IncompleteReadError as exc:  # closed for idleness as the request left: again
                await self.close()
                if last_try or exc.partial:
                    raise
        if not head.startswith(b"HTTP/1.1 200") or b"chunked" not in head.lower():
            await self.close()
            raise RuntimeError(f"the mesh answered {head[:300]!r}")
        times: list[float] = []
        pending = b""
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            if size == 0:
                break
            pending += data[:-2]
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                if event.startswith(b"data: {"):
                    choices = json.loads(event[6:])["choices"]
                    if choices and choices[0]["text"]:
                        times.append(time.perf_counter())
        return times[0] - started, [b - a for a, b in zip(times, times[1:])]


WORKER_HEALTH = re.compile(r"health checks on (http://[^/\s]+)/health/live")


def worker_metrics_url(mesh_workdir: Path, worker_id: str = "prefill-1") -> str | None:
    """A worker's ``/metrics`` URL under `kvmesh up` (it binds its health port at random and
    says where in its log)."""
    try:
        found = WORKER_HEALTH.search((mesh_workdir / "logs" / f"{worker_id}.log").read_text())
    except OSError:
        return None
    return f"{found.group(1)}/metrics" if found else None


async def worker_ttft_total(client: httpx.AsyncClient, url: str) -> float:
    """The worker's summed time to first token so far, seconds (all its requests)."""
    response = await client.get(url)
    response.raise_for_status()
    return ttft_total(response.text)


def ttft_total(metrics_text: str) -> float:
    """``kvmesh:time_to_first_token_seconds``'s sum over its series, from Prometheus text."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == "kvmesh:time_to_first_token_seconds_sum"
    )


def cpu_seconds(pids_path: Path) -> dict[str, float]:
    """CPU seconds (user + system) each process of a mesh has used so far, by name, from
    the mesh's ``pids.json`` (`LocalMesh` writes it; `kvmesh up` is one)."""
    ticks = os.sysconf("SC_CLK_TCK")
    used = {}
    for name, pid in json.loads(pids_path.read_text())["processes"].items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        used[name] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return used


def start_up(args: argparse.Namespace, workdir: Path, name: str, tree: Path | None = None):
    """`kvmesh up` from this tree or ``tree``, in a process of its own as a user runs it (both
    meshes alike: a `LocalMesh` in this process would read its children's output on threads
    beside the client). The two meshes are still not equal seats: in 2026-12-05's runs the
    one started first ("mesh") was 1.2-3.2 ms slower at TTFT whichever code it ran; run twice
    with the trees swapped to tell the code from the seat (docs/benchmarks.md, "The router's
    own copy of the KV index")."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import vllm_serving_bench as vsb

    up_args = argparse.Namespace(kv_cache_mib=256, dtype=args.dtype, ready_timeout=300.0, vllm_python=vsb.default_vllm_python())
    (workdir / name).mkdir()
    return vsb.start_kvmesh_up(name, up_args, workdir / name, ["--num-threads", str(args.threads)], tree=tree)


async def latency_bench(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-bench-"))
    mesh = await asyncio.to_thread(start_up, args, workdir, "mesh")
    baseline = await asyncio.to_thread(start_up, args, workdir, "mesh-base", args.baseline_tree) if args.baseline_tree else None
    engine = await AsyncEngine.create(EngineConfig(dtype=args.dtype, kv_cache_bytes=256 * 2**20, num_threads=args.threads))
    total = args.requests * args.rounds
    # a prompt for each request and one more for each request's socket-client twin (a mesh
    # would answer the same prompt twice from its prefix cache), and two to warm up with
    prompts = prompts_for(engine.engine.tokenizer, 2 * total + 2, args.prompt_tokens)
    # each mesh twice: through httpx (as Python clients send) and through a plain socket
    # (``SocketClient``: what the mesh adds without a client library's own cost)
    meshes = ["mesh", *(["baseline"] if baseline else [])]
    sides = ["in_process", *meshes, *(f"{name}_socket" for name in meshes)]
    results: dict[str, dict[str, list[float]]] = {side: {"ttft": [], "itl": [], "worker_ttft": []} for side in sides}
    servers = {"mesh": mesh, **({"baseline": baseline} if baseline else {})}
    urls = {name: worker_metrics_url(server.workdir / "mesh") for name, server in servers.items()}
    metrics_urls = {side: urls[side.removesuffix("_socket")] for side in sides if side != "in_process"}
    sockets = {f"{name}_socket": SocketClient(server.base_url) for name, server in servers.items()}
    try:
        async with contextlib.AsyncExitStack() as stack:
            clients = {"mesh": await stack.enter_async_context(httpx.AsyncClient(base_url=mesh.base_url, timeout=120))}
            scraper = await stack.enter_async_context(httpx.AsyncClient(timeout=10))
            if baseline:
                clients["baseline"] = await stack.enter_async_context(httpx.AsyncClient(base_url=baseline.base_url, timeout=120))

            async def one(side: str, prompt: list[int], new_tokens: int, rid: str) -> tuple[float, list[float]]:
                if side == "in_process":
                    return await in_process(engine, prompt, new_tokens, rid)
                if side in sockets:
                    return await sockets[side].completion(prompt, new_tokens)
                return await through_mesh(clients[side], prompt, new_tokens)

            for side in sides:  # warm-up
                await one(side, prompts[-1] if side != "in_process" else prompts[-2], 4, "warm")
            pids = {"mesh": mesh.workdir / "mesh" / "pids.json", **({"baseline": baseline.workdir / "mesh" / "pids.json"} if baseline else {})}
            cpu_before = {side: cpu_seconds(path) for side, path in pids.items()}
            index = 0
            for round_number in range(args.rounds):
                for _ in range(args.requests):
                    # a fresh prompt each time: no prefix-cache help; the socket sides' are others
                    # of the same length (paired with the in-process time of this one)
                    prompt, twin = prompts[index], prompts[total + index]
                    index += 1
                    turn = index % len(sides)
                    for side in sides[turn:] + sides[:turn]:
                        url = metrics_urls.get(side)
                        before = await worker_ttft_total(scraper, url) if url else 0.0
                        ttft, itl = await one(side, twin if side in sockets else prompt, args.new_tokens, f"r{index}")
                        results[side]["ttft"].append(ttft)
                        results[side]["itl"].extend(itl)
                        if url:  # the worker observed its first token before the router had it
                            results[side]["worker_ttft"].append(await worker_ttft_total(scraper, url) - before)
                logger.info("latency round %d done", round_number)
            cpu_after = {side: cpu_seconds(path) for side, path in pids.items()}
    finally:
        for connection in sockets.values():
            await connection.close()
        await engine.shutdown()
        if baseline is not None:
            await asyncio.to_thread(baseline.stop)
        await asyncio.to_thread(mesh.stop)

    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    summary = {}
    for side, values in results.items():
        summary[side] = {
            "ttft_p50_ms": pct(values["ttft"], 0.5),
            "ttft_p90_ms": pct(values["ttft"], 0.9),
            "itl_p50_ms": pct(values["itl"], 0.5),
            "itl_mean_ms": statistics.mean(values["itl"]) * 1e3,
            "requests": len(values["ttft"]),
            "ttft_ms": [round(t * 1e3, 3) for t in values["ttft"]],
        }
        if side != "in_process":  # each prompt's TTFT here less its TTFT in-process
            paired = [m - p for m, p in zip(values["ttft"], results["in_process"]["ttft"], strict=True)]
            summary[side]["ttft_added_paired_p50_ms"] = statistics.median(paired) * 1e3
            worker = values["worker_ttft"]
            if len(worker) == len(values["ttft"]):
                summary[side]["worker_ttft_p50_ms"] = pct(worker, 0.5)
                summary[side]["worker_ttft_ms"] = [round(t * 1e3, 3) for t in worker]
                # the prefill worker's engine against the in-process engine, the same prompt
                summary[side]["worker_engine_added_paired_p50_ms"] = statistics.median(
                    w - p for w, p in zip(worker, results["in_process"]["ttft"], strict=True)
                ) * 1e3
                # around the worker's engine: HTTP, the router, NATS, the worker's hand-offs
                summary[side]["path_p50_ms"] = statistics.median(m - w for m, w in zip(values["ttft"], worker, strict=True)) * 1e3
            # each service's CPU per request over the measured rounds
            if side in cpu_before:  # both clients' requests, over the httpx side's count
                summary[side]["cpu_ms_per_request"] = {
                    name: round((cpu_after[side][name] - start) * 1e3 / len(values["ttft"]) / 2, 2)
                    for name, start in cpu_before[side].items()
                    if name in cpu_after[side]
                }
    return summary


# ----------------------------------------------------------------------------- report
def machine() -> dict:
    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


def markdown(args: argparse.Namespace, transfer: list[dict], latency: dict | None) -> str:
    meta = machine()
    lines = [
        f"## Mesh benchmarks ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"Command: `{' '.join(sys.argv)}`  ",
        f"Machine: {meta['cpu']} ({meta['cpu_flags'] or 'no AVX'}), {meta['cores']} cores, Python {meta['python']}, torch {meta['torch']}",
        "",
        "### KV transfer, loopback (median of rounds)",
        "",
        "| size | blocks | Mooncake, coalesced (GB/s) | Mooncake, a range per block (GB/s) | raw socket (GB/s) | Mooncake / socket |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in transfer:
        lines.append(
            f"| {row['mib']} MiB | {row['blocks']} | {row['mooncake_gbps']:.2f} | {row['mooncake_per_block_gbps']:.2f} "
            f"| {row['socket_gbps']:.2f} | {row['mooncake_gbps'] / row['socket_gbps']:.2f}x |"
        )
    if latency:
        mesh, local = latency["mesh"], latency["in_process"]
        lines += [
            "",
            f"### Latency at low load ({args.dtype}, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
            f"{mesh['requests']} sequential requests per side, interleaved)",
            "",
            "| metric | in-process engine | through the mesh | added |",
            "|---|---:|---:|---:|",
            f"| TTFT p50 (ms) | {local['ttft_p50_ms']:.1f} | {mesh['ttft_p50_ms']:.1f} | {mesh['ttft_p50_ms'] - local['ttft_p50_ms']:+.1f} ms |",
            f"| TTFT added, median of paired differences (ms) | | | {mesh['ttft_added_paired_p50_ms']:+.1f} ms |",
            f"| TTFT p90 (ms) | {local['ttft_p90_ms']:.1f} | {mesh['ttft_p90_ms']:.1f} | {mesh['ttft_p90_ms'] - local['ttft_p90_ms']:+.1f} ms |",
            f"| inter-token p50 (ms) | {local['itl_p50_ms']:.2f} | {mesh['itl_p50_ms']:.2f} | {100 * (mesh['itl_p50_ms'] / local['itl_p50_ms'] - 1):+.1f} % |",
            f"| inter-token mean (ms) | {local['itl_mean_ms']:.2f} | {mesh['itl_mean_ms']:.2f} | {100 * (mesh['itl_mean_ms'] / local['itl_mean_ms'] - 1):+.1f} % |",
        ]
        if "path_p50_ms" in mesh:
            lines += [
                f"| the prefill worker's own TTFT (its engine) p50, and its added over in-process, paired (ms) | | {mesh['worker_ttft_p50_ms']:.1f} | {mesh['worker_engine_added_paired_p50_ms']:+.1f} ms |",
                f"| the path around the worker's engine (TTFT less the worker's own), median (ms) | | {mesh['path_p50_ms']:.1f} | |",
            ]
        plain = latency.get("mesh_socket")
        if plain:
            lines += [
                f"| TTFT p50, plain-socket client (ms) | {local['ttft_p50_ms']:.1f} | {plain['ttft_p50_ms']:.1f} | {plain['ttft_p50_ms'] - local['ttft_p50_ms']:+.1f} ms |",
                f"| TTFT added, plain-socket client, median of paired differences (ms) | | | {plain['ttft_added_paired_p50_ms']:+.1f} ms |",
                *(
                    [f"| the path around the worker's engine, plain-socket client, median (ms) | | {plain['path_p50_ms']:.1f} | |"]
                    if "path_p50_ms" in plain
                    else []
                ),
            ]
        base, plain_base = latency.get("baseline"), latency.get("baseline_socket")
        if base:
            lines += [
                "",
                f"The mesh from `{args.baseline_tree}` (the code before), up at the same time, every prompt sent to every side:",
                "",
                "| metric | this tree's mesh | the baseline's mesh |",
                "|---|---:|---:|",
                f"| TTFT p50 (ms) | {mesh['ttft_p50_ms']:.1f} | {base['ttft_p50_ms']:.1f} |",
                f"| TTFT added, median of paired differences (ms) | {mesh['ttft_added_paired_p50_ms']:+.1f} | {base['ttft_added_paired_p50_ms']:+.1f} |",
                f"| TTFT p90 (ms) | {mesh['ttft_p90_ms']:.1f} | {base['ttft_p90_ms']:.1f} |",
                f"| inter-token p50 (ms) | {mesh['itl_p50_ms']:.2f} | {base['itl_p50_ms']:.2f} |",
                f"| inter-token mean (ms) | {mesh['itl_mean_ms']:.2f} | {base['itl_mean_ms']:.2f} |",
                *(
                    [
                        f"| the prefill worker's own TTFT added over in-process, paired (ms) | {mesh['worker_engine_added_paired_p50_ms']:+.1f} | {base['worker_engine_added_paired_p50_ms']:+.1f} |",
                        f"| the path around the worker's engine, median (ms) | {mesh['path_p50_ms']:.1f} | {base['path_p50_ms']:.1f} |",
                    ]
                    if "path_p50_ms" in mesh and "path_p50_ms" in base
                    else []
                ),
                *(
                    [
                        f"| TTFT added, plain-socket client, paired (ms) | {plain['ttft_added_paired_p50_ms']:+.1f} | {plain_base['ttft_added_paired_p50_ms']:+.1f} |",
                        f"| the path around the worker's engine, plain-socket client, median (ms) | {plain['path_p50_ms']:.1f} | {plain_base['path_p50_ms']:.1f} |",
                    ]
                    if plain and plain_base and "path_p50_ms" in plain and "path_p50_ms" in plain_base
                    else []
                ),
                *(
                    f"| CPU over the rounds a request, idle work included: {name} (ms) | {mesh['cpu_ms_per_request'].get(name, 0):.2f} | {base['cpu_ms_per_request'].get(name, 0):.2f} |"
                    for name in mesh["cpu_ms_per_request"]
                ),
            ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", default="1,4,16,64")
    parser.add_argument("--block-kib", type=int, default=720, help="bytes per block (SmolLM2 float32, 16 tokens: 720 KiB)")
    parser.add_argument("--transfer-rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads per engine (in-process and each worker)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=10, help="per round and side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--baseline-tree", type=Path, help="also a mesh from this checkout (`kvmesh up`), up at the same time")
    parser.add_argument("--out", type=Path, help="raw numbers as JSON")
    parser.add_argument("--markdown", type=Path, help="append the tables to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # on a thread that ends: its torch work would otherwise leave this (main) thread an OpenMP
    # pool for good, and the in-process engine's steps would run at half speed beside it
    # (``kvmesh.engine.own_thread``)
    transfer = call_in_own_thread(
        lambda: transfer_bench([int(s) for s in args.sizes_mib.split(",")], args.transfer_rounds, args.block_kib * 1024), "transfer-bench"
    )
    latency = None if args.skip_latency else asyncio.run(latency_bench(args))
    report = markdown(args, transfer, latency)
    print(report)
    if args.out:
        args.out.write_text(json.dumps({"machine": machine(), "args": vars(args) | {"out": str(args.out), "markdown": str(args.markdown)}, "transfer": transfer, "latency": latency}, indent=2, default=str))
    if args.markdown:
        with args.markdown.open("a") as handle:
            handle.write("\n" + report)


if __name__ == "__main__":
    main()
