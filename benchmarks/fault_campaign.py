"""Fault campaign against `kvmesh up`: streaming clients for a while, each service killed in
turn (and nats-server and etcd restarted), then the pools checked.

It starts its own `kvmesh up` (supervised: every child that dies is restarted) on free
loopback ports, runs N streaming clients in a loop, and while they run SIGKILLs, one after
another with the previous one back first: a prefill worker, a decode worker, kv-metadata,
nats-server, etcd, and last the router (a router's death cuts the streams it carries: those
failures are counted apart). It reports requests ok / failed per fault, the longest silence a
client saw (the longest gap between two SSE events of one stream, first byte included),
overall and right after each worker death, and blocks in use / held / pinned on every worker
afterwards. Bounded in time and requests; loopback only.

    .venv/bin/python benchmarks/fault_campaign.py --clients 64 --duration 60 --json docs/benchmarks-faults.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, UTC
from pathlib import Path

import httpx
import nats

from kvmesh.machine import cpu_flags, cpu_model
from kvmesh.protocol import Subjects, WorkerStats
from kvmesh.security.tls import client_context

logger = logging.getLogger("fault_campaign")

MODEL = "SmolLM2-135M-Instruct"
SERVING = re.compile(r"kvmesh is serving at (http://\S+)/v1")
PROMPTS = [
    "Tell me about the rivers of Europe.",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three facts about the Moon.",
    "What is the capital of France, and why is it famous?",
    "Describe how bread is made.",
    "Give me advice for learning to program.",
    "Summarize the plot of a detective story.",
]
# In this order; the router last, since its death cuts the streams it carries. "prefill"
# and "decode" name the first worker of that role.
FAULTS = ["prefill", "decode", "kv-metadata", "nats-server", "etcd", "router"]
FAILED_REQUEST_PAUSE = 0.5  # seconds a client waits after a failed request, as clients do


@dataclass(slots=True)
class Outcome:
    started: float
    ended: float
    ok: bool
    error: str = ""
    longest_gap: float = 0.0  # seconds, between two events of the stream (first byte included)
    gaps_at: list[tuple[float, float]] = field(default_factory=list)  # (when, gap) for gaps > 1 s


@dataclass(slots=True)
class Fault:
    target: str
    at: float
    back_after: float | None = None  # seconds until it was running again


# ----------------------------------------------------------------------------- the mesh
class Mesh:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.workdir = workdir
        argv = [
            sys.executable, "-m", "kvmesh", "up", "--port", "0", "--host", "127.0.0.1",
            "--prefill", str(args.prefill), "--decode", str(args.decode),
            "--kv-cache-mib", str(args.kv_cache_mib), "--workdir", str(workdir),
        ]  # fmt: skip
        self.log = (workdir / "campaign-up.log").open("w")
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)
        self.base_url = ""

    def wait_serving(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        assert self.process.stdout is not None
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"kvmesh up exited ({self.process.poll()}); see {self.log.name}")
            match = SERVING.search(line)
            if match:
                self.base_url = match.group(1)
                if not self.base_url.startswith(("http://127.", "http://localhost")):
                    raise RuntimeError(f"refusing a non-loopback URL {self.base_url}")
                return self.base_url
        raise RuntimeError("kvmesh up did not start in time")

    def info(self) -> dict:
        return json.loads((self.workdir / "pids.json").read_text())

    def pid(self, name: str) -> int | None:
        return self.info()["processes"].get(name)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                return self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait()


async def wait_ready(client: httpx.AsyncClient, base_url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (await client.get(f"{base_url}/health", timeout=2)).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    return False


# ----------------------------------------------------------------------------- clients
async def one_request(client: httpx.AsyncClient, base_url: str, prompt: str, max_tokens: int) -> Outcome:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}  # fmt: skip
    started = last = time.monotonic()
    outcome = Outcome(started, started, ok=False)
    try:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.monotonic()
                gap = now - last
                last = now
                outcome.longest_gap = max(outcome.longest_gap, gap)
                if gap > 1.0:
                    outcome.gaps_at.append((now, gap))
                data = line[len("data: ") :]
                if data == "[DONE]":
                    outcome.ok = not outcome.error
                    return outcome
                event = json.loads(data)
                if "error" in event:
                    outcome.error = event["error"].get("message", "error event")
            outcome.error = outcome.error or "the stream ended without [DONE]"
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        outcome.ended = time.monotonic()
    return outcome


async def client_loop(client, base_url, stop_at: float, max_tokens: int, number: int, outcomes: list[Outcome]) -> None:
    index = number
    while time.monotonic() < stop_at:
        outcome = await one_request(client, base_url, PROMPTS[index % len(PROMPTS)], max_tokens)
        outcomes.append(outcome)
        index += 1
        if not outcome.ok:
            await asyncio.sleep(FAILED_REQUEST_PAUSE)


# ----------------------------------------------------------------------------- faults
async def inject(mesh: Mesh, client: httpx.AsyncClient, faults: list[str], start: float, duration: float) -> list[Fault]:
    done: list[Fault] = []
    spacing = duration / (len(faults) + 1)
    for number, target in enumerate(faults, start=1):
        await asyncio.sleep(max(0.0, start + number * spacing - time.monotonic()))
        if target in ("prefill", "decode"):
            target = min(name for name in mesh.info()["processes"] if name.startswith(f"{target}-"))
        pid = mesh.pid(target)
        if pid is None:
            logger.warning("%s is not running; skipped", target)
            continue
        fault = Fault(target, time.monotonic())
        logger.info("SIGKILL %s (pid %d)", target, pid)
        os.kill(pid, signal.SIGKILL)
        done.append(fault)
        deadline = fault.at + spacing
        while time.monotonic() < deadline:
            new = mesh.pid(target)
            if new is not None and new != pid:
                if await wait_ready(client, mesh.base_url, max(0.1, deadline - time.monotonic())):
                    fault.back_after = time.monotonic() - fault.at
                break
            await asyncio.sleep(0.1)
        logger.info("%s back after %s s", target, f"{fault.back_after:.1f}" if fault.back_after else "?")
    return done


async def pool_stats(nats_url: str, worker_ids: list[str], tls_ca: str | None = None) -> dict[str, dict]:
    tls = {"tls": client_context(tls_ca), "tls_handshake_first": True} if tls_ca else {}  # kvmesh up's default: TLS
    nc = await nats.connect(nats_url, connect_timeout=5, **tls)
    try:
        result = {}
        for worker_id in worker_ids:
            try:
                reply = await nc.request(Subjects("default").stats(worker_id), b"", timeout=3)
            except Exception:  # noqa: BLE001 - no such worker in this mesh
                continue
            stats = WorkerStats.decode(reply.data)
            result[worker_id] = {"in_use": stats.num_in_use, "held": stats.num_held, "pins": stats.pins}
        return result
    finally:
        await nc.close()


def summarize(outcomes: list[Outcome], faults: list[Fault], start: float) -> dict:
    def window_of(outcome: Outcome) -> str:
        """The last fault before the request ended (its failure is blamed on it)."""
        blamed = "none"
        for fault in faults:
            if fault.at <= outcome.ended:
                blamed = fault.target
        return blamed

    by_fault: dict[str, dict[str, int]] = {}
    for outcome in outcomes:
        row = by_fault.setdefault(window_of(outcome), {"ok": 0, "failed": 0})
        row["ok" if outcome.ok else "failed"] += 1
    after_fault = {}
    for number, fault in enumerate(faults):
        until = faults[number + 1].at if number + 1 < len(faults) else float("inf")
        gaps = [gap for o in outcomes for when, gap in o.gaps_at if fault.at <= when < until]
        after_fault[fault.target] = round(max(gaps, default=0.0), 2)
    first_fault = faults[0].at if faults else float("inf")
    quiet = [o.longest_gap for o in outcomes if o.ended < first_fault]
    failures = [o for o in outcomes if not o.ok]
    router_cut = [o for o in failures if window_of(o) == "router"]
    return {
        "requests": len(outcomes),
        "ok": len(outcomes) - len(failures),
        "failed": len(failures),
        "failed_excluding_router_death": len(failures) - len(router_cut),
        "by_fault": by_fault,
        "longest_silence_s": round(max((o.longest_gap for o in outcomes), default=0.0), 2),
        "longest_silence_before_any_fault_s": round(max(quiet, default=0.0), 2),
        "longest_silence_after_fault_s": after_fault,
        "faults": [  # back: restarted, and the mesh ready again
            {"target": f.target, "at_s": round(f.at - start, 1), "back_after_s": f.back_after and round(f.back_after, 2)}
            for f in faults
        ],
        "errors": sorted({o.error for o in failures})[:20],
    }


async def campaign(args: argparse.Namespace) -> dict:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvmesh-faults-"))
    mesh = Mesh(args, workdir)
    try:
        base_url = await asyncio.to_thread(mesh.wait_serving, 600)
        info = mesh.info()
        limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
            # Warm-up: one request per prompt, so the prefix caches hold the chat template.
            for prompt in PROMPTS:
                await one_request(client, base_url, prompt, 4)
            start = time.monotonic()
            stop_at = start + args.duration
            outcomes: list[Outcome] = []
            clients = [
                asyncio.create_task(client_loop(client, base_url, stop_at, args.max_tokens, n, outcomes))
                for n in range(args.clients)
            ]
            faults = await inject(mesh, client, [f for f in args.faults.split(",") if f], start, args.duration)
            await asyncio.wait_for(asyncio.gather(*clients), args.duration + 300)
            await wait_ready(client, base_url, 60)
            # Pins of requests whose router died are freed by their lease (the pin TTL, 30 s).
            ended = time.monotonic()
            while True:
                now = mesh.info()
                workers = sorted(name for name in now["processes"] if name.startswith(("prefill-", "decode-")))
                pools = await pool_stats(now["nats_url"] or info["nats_url"], workers, info.get("tls_ca"))
                at_baseline = all(v == {"in_use": 0, "held": 0, "pins": 0} for v in pools.values())
                if at_baseline or time.monotonic() - ended > args.pin_wait:
                    break
                await asyncio.sleep(1.0)
        result = summarize(outcomes, faults, start)
        result["pools_after"] = pools
        result["pools_at_baseline"] = at_baseline
        result["pools_at_baseline_after_s"] = round(time.monotonic() - ended, 1) if at_baseline else None
        return result
    finally:
        code = await asyncio.to_thread(mesh.stop)
        logger.info("kvmesh up exited with %s", code)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic (faults spread over it)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--kv-cache-mib", type=int, default=128)
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, in order")
    parser.add_argument("--pin-wait", type=float, default=45.0, help="seconds to wait for the pools to drain after")
    parser.add_argument("--workdir")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    if not 1 <= args.clients <= 256 or not 1 <= args.duration <= 900:
        parser.error("--clients must be 1..256 and --duration 1..900 (a bounded campaign)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    began = time.time()
    result = asyncio.run(campaign(args))
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "flags": cpu_flags()},
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "workdir")},
        "wall_s": round(time.time() - began, 1),
        **result,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
