"""What the mesh's authentication and TLS cost: TTFT and throughput with NATS users, etcd
roles and TLS on NATS and etcd (the default of `kvmesh up`), with auth alone, and with
neither (anonymous, plaintext), side by side in one run.

Three local meshes (1 prefill + 1 decode worker each, one thread per worker) run at once;
requests go to each in turn (who goes first rotates), so all see the same machine.
Sequential requests on fresh prompts give TTFT; rounds of concurrent requests give output
tokens/s (the mesh that goes first rotates too). Then, because a request's few NATS hops
are what TLS adds to, one NATS request/reply round trip (1 KiB each way, a client and a
responder as the services connect) is timed on a plaintext and a TLS nats-server.

    .venv/bin/python benchmarks/auth_cost.py --json docs/benchmarks-auth.json
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
from datetime import UTC, datetime
from pathlib import Path

import httpx

from kvmesh.infra.local_mesh import LocalMesh, MeshOptions
from kvmesh.machine import cpu_flags, cpu_model

logger = logging.getLogger("auth_cost")

MODEL = "SmolLM2-135M-Instruct"


def prompt(number: int) -> str:
    return f"Request {number}: write one sentence about the number {number * 7919 % 1000}."


async def ttft(client: httpx.AsyncClient, text: str, new_tokens: int) -> tuple[float, int, float]:
    """Seconds to the first token, tokens received, seconds to the last."""
    body = {"model": MODEL, "prompt": text, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0]["text"]:
                    first = first or time.perf_counter()
                    tokens += 1
    assert first is not None
    return first - started, tokens, time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(args: argparse.Namespace) -> dict:
    meshes = {}
    variants = [("auth_tls", True, True), ("auth", True, False), ("anonymous", False, False)]
    for name, auth, tls in reversed(variants) if args.reverse else variants:  # started (and first asked) in this order
        options = MeshOptions(kv_cache_mib=128, num_threads=1, auth=auth, tls=tls)
        meshes[name] = LocalMesh(options, Path(tempfile.mkdtemp(prefix=f"kvmesh-{name}-")))
        await asyncio.to_thread(meshes[name].start)
    results: dict[str, dict[str, list[float]]] = {name: {"ttft": [], "tok_s": []} for name in meshes}
    try:
        clients = {name: httpx.AsyncClient(base_url=mesh.base_url, timeout=120) for name, mesh in meshes.items()}
        for client in clients.values():
            await ttft(client, "warm up", 4)
        number = 0
        for round_number in range(args.rounds):
            for index in range(args.requests):  # sequential, in turn (who goes first rotates): TTFT
                order = list(clients.items())
                for name, client in order[index % len(order) :] + order[: index % len(order)]:
                    number += 1
                    seconds, _, _ = await ttft(client, prompt(number), args.new_tokens)
                    results[name]["ttft"].append(seconds)
            order = list(clients.items())
            for name, client in order[round_number % len(order) :] + order[: round_number % len(order)]:  # bursts: throughput
                started = time.perf_counter()
                done = await asyncio.gather(*(ttft(client, prompt(number + i + 1), args.new_tokens) for i in range(args.concurrency)))
                number += args.concurrency
                results[name]["tok_s"].append(sum(d[1] for d in done) / (time.perf_counter() - started))
            logger.info("round %d done", round_number)
        for client in clients.values():
            await client.aclose()
    finally:
        for mesh in meshes.values():
            await asyncio.to_thread(mesh.stop)
    summary = {}
    for name, values in results.items():
        summary[name] = {
            "ttft_p50_ms": round(1e3 * pct(values["ttft"], 0.5), 2),
            "ttft_p99_ms": round(1e3 * pct(values["ttft"], 0.99), 2),
            "output_tok_s_median": round(statistics.median(values["tok_s"]), 1),
            "requests": len(values["ttft"]),
        }
    summary["nats_round_trip"] = await nats_round_trips(args.round_trips)
    base = summary["anonymous"]
    for name in ("auth_tls", "auth"):
        summary[f"{name}_ttft_p50_added_ms"] = round(summary[name]["ttft_p50_ms"] - base["ttft_p50_ms"], 2)
        # The i-th sequential request on each mesh, sent one right after the other: the median of these
        # differences cancels the machine's slower drifts (other jobs), which p50s do not.
        paired = [a - b for a, b in zip(results[name]["ttft"], results["anonymous"]["ttft"])]
        summary[f"{name}_ttft_paired_median_added_ms"] = round(1e3 * statistics.median(paired), 2)
        summary[f"{name}_throughput_ratio"] = round(summary[name]["output_tok_s_median"] / base["output_tok_s_median"], 3)
    return summary


async def nats_round_trips(count: int) -> dict[str, float]:
    """p50 / p99 microseconds of one request/reply through nats-server, plaintext and TLS."""
    import nats

    from kvmesh.infra.servers import start_nats
    from kvmesh.security.tls import LOCAL_HOSTS, MeshTLS

    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-nats-rtt-"))
    tls = MeshTLS.generate(workdir / "tls", {"nats": LOCAL_HOSTS})
    result: dict[str, float] = {}
    for name, server_tls in (("plaintext", None), ("tls", tls)):
        server = start_nats(workdir / name, tls=server_tls)
        try:
            responder = await nats.connect(server.address, **server.connect_options())
            client = await nats.connect(server.address, **server.connect_options())

            async def answer(msg) -> None:
                await msg.respond(msg.data)

            await responder.subscribe("rtt", cb=answer)
            await responder.flush()
            payload = os.urandom(1024)
            times = []
            for i in range(count + 100):
                started = time.perf_counter()
                await client.request("rtt", payload, timeout=5)
                if i >= 100:  # the first ones warm up
                    times.append(time.perf_counter() - started)
            await client.close()
            await responder.close()
        finally:
            server.stop()
        result[f"{name}_p50_us"] = round(1e6 * pct(times, 0.5), 1)
        result[f"{name}_p99_us"] = round(1e6 * pct(times, 0.99), 1)
    result["tls_added_p50_us"] = round(result["tls_p50_us"] - result["plaintext_p50_us"], 1)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20, help="sequential requests per mesh per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--reverse", action="store_true", help="start the meshes in the other order (anonymous first)")
    parser.add_argument("--round-trips", type=int, default=2000, help="NATS request/reply round trips per server")
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "flags": cpu_flags()},
        "config": vars(args),
        **asyncio.run(run(args)),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
