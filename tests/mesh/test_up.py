"""``kvmesh up`` as a user runs it: it supervises its children and stops them all.

One ``kvmesh up --prefill 2 --decode 2`` serves the first stories: 16 greedy streams run
while a decode worker, then a prefill worker, is SIGKILLed; every stream still ends with
``[DONE]`` and the same text as before the fault, and the worker comes back (new PID, same
id) and serves again; etcd, nats-server, kv-metadata and the router killed together come
back where they were. A Ctrl-C on that idle mesh stops everything within 5 s. Smaller
meshes show a Ctrl-C mid-stream (the client gets an error event and ``[DONE]``), SIGHUP and
SIGTERM, and a SIGKILLed ``kvmesh up`` (PR_SET_PDEATHSIG): no process is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import nats
import pytest
import torch

from kvmesh.engine.model import paged_kernel, small_batch
from kvmesh.machine import cpu_has_amx, default_dtype, threads_per_worker, usable_cores
from kvmesh.protocol import Subjects, WorkerStats
from kvmesh.security.tls import client_context
from tests.mesh.client import post, stream, streamed_text
from tests.mesh.meshes import process_gone

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
STREAMS = 16
TOKENS = 48


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:300]
    except OSError:
        return "?"


def wait_all_gone(pids: list[int], timeout: float) -> list[int]:
    """The PIDs still alive after ``timeout`` seconds (none, hopefully)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if not process_gone(pid)]
        if not alive:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if not process_gone(pid)]


class Up:
    """A running ``kvmesh up``: its output lines as they come, and its ``pids.json``."""

    def __init__(self, workdir: Path, cache_root: Path, *args: str, kv_cache_mib: int = 32, unset: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.lines: list[str] = []  # stdout and stderr, in arrival order
        self.children_seen: set[int] = set()
        self._cond = threading.Condition()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "up", "--port", "0", "--kv-cache-mib", str(kv_cache_mib), "--workdir", str(workdir), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**{k: v for k, v in os.environ.items() if k not in unset}, "KVMESH_CACHE_DIR": str(cache_root)},
        )
        self._readers = [threading.Thread(target=self._read, args=(pipe,), daemon=True) for pipe in (self.popen.stdout, self.popen.stderr)]
        for reader in self._readers:
            reader.start()
        try:
            line = self.wait_line(lambda text: "kvmesh is serving at" in text, timeout=240)
            self.base_url = re.search(r"serving at (http://\S+)/v1", line).group(1)
            self.info = self.read_pids()
        except BaseException:
            self.cleanup()
            raise

    def _read(self, pipe) -> None:
        for line in pipe:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_line(self, predicate: Callable[[str], bool], timeout: float, start: int = 0) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[start:]:
                    if predicate(line):
                        return line
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.popen.poll() is not None and not any(r.is_alive() for r in self._readers)):
                    raise AssertionError(f"no such line after {timeout}s; output:\n" + "\n".join(self.lines[-40:]))
                self._cond.wait(min(remaining, 0.2))

    def read_pids(self) -> dict:
        info = json.loads((self.workdir / "pids.json").read_text())
        self.children_seen |= set(info["processes"].values())
        return info

    def pid(self, name: str) -> int:
        return self.read_pids()["processes"][name]

    @property
    def nats_url(self) -> str:
        return self.info["nats_url"]

    async def worker_stats(self, worker_id: str) -> WorkerStats:
        """A worker's pool stats, asked as the admin over TLS (``kvmesh up``'s default),
        trusting the mesh's CA from ``pids.json``."""
        tls = {"tls": client_context(self.info["tls_ca"]), "tls_handshake_first": True} if self.info.get("tls_ca") else {}
        nc = await nats.connect(self.nats_url, connect_timeout=5, **tls)
        try:
            return WorkerStats.decode((await nc.request(Subjects("default").stats(worker_id), b"", timeout=5)).data)
        finally:
            await nc.close()

    def stop(self, signum: int = signal.SIGINT, timeout: float = 30) -> tuple[int, float]:
        """Send ``signum``; the exit code and the seconds it took to exit."""
        began = time.monotonic()
        self.popen.send_signal(signum)
        code = self.popen.wait(timeout)
        return code, time.monotonic() - began

    def cleanup(self) -> None:
        """Whatever a failed test left: kvmesh up SIGKILLed (its children follow), and
        every child this test ever saw, by PID."""
        if (self.workdir / "pids.json").exists():
            self.read_pids()
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        for pid in wait_all_gone(sorted(self.children_seen), timeout=15):
            os.kill(pid, signal.SIGKILL)


def start_up(tmp_path: Path, default_model_dir: Path, *args: str, kv_cache_mib: int = 32, unset: tuple[str, ...] = ()) -> Up:
    return Up(tmp_path, default_model_dir.parent.parent, *args, kv_cache_mib=kv_cache_mib, unset=unset)


# --------------------------------------------------------------------------------- 2 + 2
PROMPTS = [
    "Tell me a story about a lighthouse keeper:", "List some facts about the Moon:", "Write a poem about rivers:",
    "Explain how bread is made:", "Describe a busy market in the morning:", "What do cats like to do?",
    "Give advice to a new gardener:", "Describe the sound of rain:",
]  # fmt: skip


def bodies() -> list[tuple[str, dict]]:
    """8 completions and 8 chat completions, greedy, each ``TOKENS`` tokens long."""
    common = {"model": MODEL, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    out = [("/v1/completions", {**common, "prompt": p}) for p in PROMPTS]
    out += [("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": p}]}) for p in PROMPTS]
    assert len(out) == STREAMS
    return out


def answer_text(path: str, response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"] if path == "/v1/completions" else choice["message"]["content"]


@pytest.fixture(scope="module")
def mesh22(tmp_path_factory, default_model_dir):
    # 96 MiB (135 blocks): the survivor of a kill must hold all 16 streams (about 80 blocks);
    # 32 MiB (45 blocks) would make the test one of capacity, not of redundancy.
    up = start_up(tmp_path_factory.mktemp("up22"), default_model_dir, "--prefill", "2", "--decode", "2", kv_cache_mib=96)
    yield up
    up.cleanup()


@pytest.fixture(scope="module")
def references(mesh22) -> list[str]:
    """Each request's answer, taken before any fault (all at once, as the streams will run)."""

    async def answers() -> list[str]:
        return list(await asyncio.gather(*(post_text(mesh22.base_url, path, body) for path, body in bodies())))

    return asyncio.run(answers())


async def post_text(base_url: str, path: str, body: dict) -> str:
    return answer_text(path, await post(base_url, path, body))


async def assert_restarted_and_serving(up: Up, name: str, old_pid: int, since: int) -> None:
    """The restart was logged, the worker registered again (new PID, same id), and a
    request through the router is served on it."""
    up.wait_line(lambda text: f"{name} exited (signal 9); restarting in" in text, timeout=10, start=since)
    up.wait_line(lambda text: f"deleted the etcd record of {name}" in text, timeout=10, start=since)
    back = up.wait_line(lambda text: f"{name} is back (pid" in text, timeout=120, start=since)
    new_pid = int(re.search(r"pid (\d+)", back).group(1))
    assert new_pid != old_pid and up.pid(name) == new_pid
    assert process_gone(old_pid)
    before = await up.worker_stats(name)
    assert before.transfers == 0 and before.bytes_served == 0  # a fresh process
    for round_ in range(10):  # new prompts (cached nowhere), 4 at once: spread over the role's workers
        prompts = [f"Request {i} of round {round_} after {name} came back: say hello" for i in range(4)]
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0}
        await asyncio.gather(*(post_text(up.base_url, "/v1/completions", {**body, "prompt": p}) for p in prompts))
        stats = await up.worker_stats(name)
        if stats.transfers > 0 or stats.bytes_served > 0:
            return
    raise AssertionError(f"{name} restarted but served nothing: {stats}")


async def run_streams_with_a_kill(up: Up, kill_when: Callable[[list[list[dict]]], object]) -> list[list[dict]]:
    """Start all streams; ``kill_when(events so far per stream)`` is polled until it returns
    true (it does the killing); then every stream is awaited."""
    events: list[list[dict]] = [[] for _ in range(STREAMS)]

    def collector(i: int):
        async def on_event(so_far: list[dict]) -> None:
            events[i] = list(so_far)

        return on_event

    tasks = [asyncio.create_task(stream(up.base_url, path, body, timeout=120, on_event=collector(i))) for i, (path, body) in enumerate(bodies())]
    deadline = time.monotonic() + 60
    while not await kill_when(events):
        for task in tasks:
            if task.done():
                task.result()  # a stream that failed before the kill: its error
        assert time.monotonic() < deadline, "the moment to kill never came"
        assert not all(t.done() for t in tasks), "every stream finished before the kill"
        await asyncio.sleep(0.02)
    return list(await asyncio.wait_for(asyncio.gather(*tasks), 120))


def assert_streams_unharmed(results: list[list[dict]], references: list[str]) -> None:
    for (path, _), events, want in zip(bodies(), results, references):
        assert not [e for e in events if "error" in e], (path, events[-1])
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert streamed_text(events) == want, path


async def test_a_killed_decode_worker_is_restarted_and_no_stream_is_cut(mesh22, references):
    """Its streams resume on the other decode worker; and, the workers lending each other their
    cores (``kvmesh up``'s default here), its byte on the board is idle once it is seen dead, long
    before its restart is back, so the survivors do not wait for a borrower that is gone."""
    up, victim = mesh22, "decode-3"
    old_pid, since = up.pid(victim), len(up.lines)
    lending = "--lend-cores" in Path(f"/proc/{old_pid}/cmdline").read_bytes().decode().split("\0")
    board_at_death: list[bytes] = []

    def board_when_seen_dead() -> None:
        # the etcd record goes right after the board's byte, both once the supervisor sees it dead
        up.wait_line(lambda text: f"deleted the etcd record of {victim}" in text, timeout=10, start=since)
        board_at_death.append((up.workdir / "cores").read_bytes()[2:3])  # decode-3: the third worker, slot 2
        assert not any(f"{victim} is back" in line for line in up.lines[since:])

    async def kill_once_decoding(events: list[list[dict]]) -> bool:
        if sum(len(e) >= 3 for e in events) < STREAMS // 2:  # half the streams decoding (the rest may queue)
            return False
        if (await up.worker_stats(victim)).num_in_use == 0:
            return False
        os.kill(old_pid, signal.SIGKILL)
        return True

    watcher = asyncio.create_task(asyncio.to_thread(board_when_seen_dead)) if lending else None
    results = await run_streams_with_a_kill(up, kill_once_decoding)
    assert_streams_unharmed(results, references)
    if watcher is not None:
        await watcher
        assert board_at_death == [b"\x00"]
    await assert_restarted_and_serving(up, victim, old_pid, since)


async def test_a_killed_prefill_worker_is_restarted_and_no_stream_is_cut(mesh22, references):
    up, victim = mesh22, "prefill-1"
    old_pid, since = up.pid(victim), len(up.lines)

    async def kill_while_prefilling(events: list[list[dict]]) -> bool:
        stats = await up.worker_stats(victim)
        if stats.num_in_use + stats.num_held + stats.pins == 0:  # holding no request's KV yet
            return False
        os.kill(old_pid, signal.SIGKILL)
        return True

    results = await run_streams_with_a_kill(up, kill_while_prefilling)
    assert_streams_unharmed(results, references)
    await assert_restarted_and_serving(up, victim, old_pid, since)


async def test_killed_servers_and_router_come_back_where_they_were(mesh22):
    """etcd, nats-server, kv-metadata and the router SIGKILLed at once: each is restarted
    (etcd and nats on their ports, etcd with its data, the router on its URL), the services
    reconnect, and the same URL serves the same answer again."""
    up = mesh22
    path, body = bodies()[0]
    want = await post_text(up.base_url, path, body)
    names = ["etcd", "nats-server", "kv-metadata", "router"]
    old = {name: up.pid(name) for name in names}
    since = len(up.lines)
    for pid in old.values():
        os.kill(pid, signal.SIGKILL)
    for name in names:
        back = up.wait_line(lambda text, n=name: text.startswith(f"kvmesh up: {n} is back (pid"), timeout=60, start=since)
        assert int(re.search(r"pid (\d+)", back).group(1)) != old[name]
    info = up.read_pids()
    assert (info["base_url"], info["nats_url"], info["etcd"]) == (up.base_url, up.info["nats_url"], up.info["etcd"])
    assert info["tls_ca"] == up.info["tls_ca"] and info["tls_ca"]  # TLS on by default, the same CA after the restarts
    deadline, last = time.monotonic() + 60, None
    while True:  # until the workers are registered and reachable again
        try:
            response = await post(up.base_url, path, body, timeout=30)
            if response.status_code == 200:
                break
            last = response.text
        except httpx.HTTPError as exc:
            last = repr(exc)
        assert time.monotonic() < deadline, last
        await asyncio.sleep(0.2)
    assert answer_text(path, response) == want


async def test_ctrl_c_on_the_idle_mesh_stops_everything_within_5_s(mesh22):
    """Run last in this module: it stops the shared mesh."""
    up = mesh22
    pids = [up.popen.pid, *up.read_pids()["processes"].values()]
    code, took = up.stop(signal.SIGINT)
    assert code == 0 and took < 5, (code, took)
    assert wait_all_gone(pids, timeout=2) == []
    assert "kvmesh up: stopped" in up.lines
    assert not (up.workdir / "pids.json").exists()


# ---------------------------------------------------------------------- smaller meshes
async def test_ctrl_c_mid_stream_ends_the_stream_with_an_error_and_done(tmp_path, default_model_dir):
    up = start_up(tmp_path, default_model_dir)  # the default: one prefill, one decode worker
    try:
        pids = [up.popen.pid, *up.info["processes"].values()]
        body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        signalled = []

        async def ctrl_c(events: list[dict]) -> None:
            if len(events) == 5:
                signalled.append(time.monotonic())
                up.popen.send_signal(signal.SIGINT)

        events = await stream(up.base_url, "/v1/completions", body, timeout=60, on_event=ctrl_c)  # asserts [DONE]
        assert signalled and "error" in events[-1], events[-1]
        assert await asyncio.to_thread(up.popen.wait, 30) == 0
        took = time.monotonic() - signalled[0]
        assert took < 8, took
        assert wait_all_gone(pids, timeout=2) == []
    finally:
        up.cleanup()


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM], ids=["SIGHUP", "SIGTERM"])
def test_a_hangup_or_terminate_stops_every_child(tmp_path, default_model_dir, signum):
    up = start_up(tmp_path, default_model_dir, "--prefill", "0", "--decode", "1")
    try:
        pids = list(up.info["processes"].values())
        assert len(pids) == 5  # nats-server, etcd, kv-metadata, decode-1, router
        code, took = up.stop(signum)
        assert code == 0 and took < 5, (code, took)
        assert wait_all_gone(pids, timeout=2) == []
    finally:
        up.cleanup()


def test_a_sigkilled_kvmesh_up_takes_its_children_along(tmp_path, default_model_dir):
    up = start_up(tmp_path, default_model_dir, "--prefill", "0", "--decode", "1")
    try:
        names = {pid: name for name, pid in up.info["processes"].items()}
        up.popen.kill()  # no handler runs: PR_SET_PDEATHSIG does the work
        up.popen.wait(10)
        # Each child gets SIGKILL from the kernel as its parent dies (a SIGTERM was once left
        # unread past 60 s), so they are gone at once; 20 s leaves a loaded machine room.
        left = wait_all_gone(list(names), timeout=20)
        assert left == [], {pid: (names[pid], _cmdline(pid)) for pid in left}
    finally:
        up.cleanup()


def test_the_services_options_reach_the_services(tmp_path, default_model_dir):
    """One ``kvmesh up`` with router and worker options: the served model name is the API's and
    the workers' (a request naming it is served), CORS is on, and each flag is on the command
    line of the services it belongs to (the mesh-wide deadline in their environment). With no
    ``--dtype`` / KVMESH_DTYPE (the suite's float32 removed) and no ``--num-threads``, the
    machine decides both and ``kvmesh up`` says so; the worker runs that dtype with the
    compiled kernels (its log says they loaded and the small-batch linear is on for the rows this
    CPU's plan gives, and on a CPU with AMX in bfloat16 the tile kernel too)."""
    origin = "http://localhost:3000"
    up = start_up(
        tmp_path, default_model_dir, "--prefill", "0", "--decode", "1",
        "--served-model-name", "foo", "--cors-allow-origins", origin, "--max-num-seqs", "4",
        "--generation-config", "vllm", "--request-deadline", "600", "--pin-write-delay", "0.5", "--kv-index", "kv-metadata",
        unset=("KVMESH_DTYPE",),
    )  # fmt: skip
    try:
        dtype, why = default_dtype()
        assert f"kvmesh up: dtype {dtype}: {why} (--dtype or KVMESH_DTYPE to choose)" in up.lines, up.lines
        threads = threads_per_worker(1)
        said = f"kvmesh up: {threads} thread(s) per worker: {usable_cores()} usable core(s) split between 1 workers"
        assert any(line.startswith(said) for line in up.lines), up.lines
        models = httpx.get(f"{up.base_url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["foo"]
        body = {"model": "foo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{up.base_url}/v1/chat/completions", json=body, headers={"Origin": origin}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.headers["access-control-allow-origin"] == origin
        assert answer.json()["model"] == "foo" and answer.json()["usage"]["completion_tokens"] >= 1
        wrong = httpx.post(f"{up.base_url}/v1/chat/completions", json={**body, "model": MODEL}, timeout=60)
        assert wrong.status_code == 404
        preflight = httpx.options(
            f"{up.base_url}/v1/responses",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
            timeout=10,
        )
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == origin

        def command_line(name: str) -> list[str]:
            return Path(f"/proc/{up.pid(name)}/cmdline").read_bytes().decode().split("\0")

        def environment(name: str) -> list[str]:
            return Path(f"/proc/{up.pid(name)}/environ").read_bytes().decode().split("\0")

        router, worker = command_line("router"), command_line("decode-1")
        for argv, flag, value in [
            (router, "--served-model-name", "foo"),
            (router, "--cors-allow-origins", origin),
            (router, "--generation-config", "vllm"),
            (router, "--kv-index", "kv-metadata"),
            (worker, "--served-model-name", "foo"),
            (worker, "--max-num-seqs", "4"),
            (worker, "--dtype", dtype),
            (worker, "--num-threads", str(threads)),
            (worker, "--pin-write-delay", "0.5"),
        ]:
            assert argv[argv.index(flag) + 1] == value, (flag, argv)
        assert "--max-num-seqs" not in router and "--cors-allow-origins" not in worker
        assert "KVMESH_REQUEST_DEADLINE=600.0" in environment("router")
        assert "KVMESH_REQUEST_DEADLINE=600.0" in environment("decode-1")
        # the machine's dtype runs the compiled kernels in the worker, not PyTorch's fallbacks
        worker_log = (up.workdir / "logs" / "decode-1.log").read_text()
        assert "compiled CPU kernels loaded" in worker_log, worker_log[-3000:]
        assert "compiled decode attention unavailable" not in worker_log, worker_log[-3000:]
        assert "small-batch linear kernel: on" in worker_log, worker_log[-3000:]
        if paged_kernel.available():  # bfloat16 without AMX: one row, then the packed kernel
            amx = cpu_has_amx()
            without_amx = dtype == "bfloat16" and not amx
            lanes = small_batch.f32_packed_lanes() if small_batch.f32_packed_available() else 0
            rows = small_batch.small_rows(getattr(torch, dtype), amx, lanes)
            if rows:  # none for float32 where the packed kernel is built for AVX2: it takes every row
                assert f"small-batch kernel for {'one row' if rows == 1 else f'up to {rows} rows'}" in worker_log, worker_log[-3000:]
            if without_amx and small_batch.vnni_available():
                words = f"packed weights for AVX512-BF16 dot products for {rows + 1}-{small_batch.VNNI_ROWS} rows"
                assert words in worker_log, worker_log[-3000:]
            if dtype == "float32" and small_batch.f32_packed_available():
                words = f"packed weights for float32 fused multiply-adds for {rows + 1}-{small_batch.f32_packed_rows(lanes)} rows"
                assert words in worker_log, worker_log[-3000:]
        if dtype == "bfloat16" and paged_kernel.available() and small_batch.amx_available():  # an AMX CPU: the tiles too
            assert f"AMX tiles for 3-{small_batch.TILE_ROWS} rows" in worker_log, worker_log[-3000:]
        assert up.stop() == (0, pytest.approx(0, abs=10))
    finally:
        up.cleanup()


def test_workers_lending_each_other_cores_answer_as_one_process(tmp_path, default_model_dir):
    """``kvmesh up``, lending by default where the workers split the cores (``--lend-cores``
    where they do not, a machine of one core): each worker has its own slot on one board in the workdir,
    eight greedy requests at once (the two workers busy together, then in turn, their threads
    changing with it) answer as one process does, the board shows them busy meanwhile, and
    afterwards every worker idle, so a worker waiting for work never keeps the other from its cores.
    With ``--max-num-seqs 4`` the decode worker never runs more than four (its imports wait
    for a seat), and the lending counts say what happened (``kvmesh:core_lending``)."""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams

    by_default = usable_cores() >= 2
    up = start_up(tmp_path, default_model_dir, *(() if by_default else ("--lend-cores",)), "--max-num-seqs", "4")
    try:
        if by_default:
            assert any(line.startswith("kvmesh up: cores lent between idle workers: ") for line in up.lines), up.lines
        board = up.workdir / "cores"
        slots = []
        for name in ("prefill-1", "decode-2"):
            argv = Path(f"/proc/{up.pid(name)}/cmdline").read_bytes().decode().split("\0")
            path, slot = argv[argv.index("--lend-cores") + 1].rsplit(":", 1)
            assert Path(path) == board
            slots.append(int(slot))
        assert sorted(slots) == [0, 1]
        engine = LLMEngine(EngineConfig(model=str(default_model_dir), served_model_name=MODEL, kv_cache_bytes=32 * 2**20))
        outs = engine.generate([engine.tokenizer.encode(p) for p in PROMPTS], SamplingParams(max_tokens=TOKENS, ignore_eos=True))
        body = {"model": MODEL, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}

        running: list[float] = []  # the decode worker's running batch, as its /metrics says

        async def answers() -> list[str]:
            done = asyncio.Event()

            async def watch_running() -> None:
                while not done.is_set():
                    running.append(worker_metrics(await scrape(up, "decode-2"), "kvmesh:num_requests_running", None)[None])
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch_running())
            try:
                return list(
                    await asyncio.gather(*(post_text(up.base_url, "/v1/completions", {**body, "prompt": p}) for p in PROMPTS))
                )
            finally:
                done.set()
                await watcher

        seen: set[bytes] = set()  # the workers' bytes while they serve: their engines use the board
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen.add(board.read_bytes()[:2])
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            assert asyncio.run(answers()) == [o.text for o in outs]
        finally:
            done.set()
            watcher.join()
        assert any(any(state) for state in seen), seen
        assert 2 <= max(running) <= 4, running  # seen batching, never past --max-num-seqs
        # The decode worker decodes a long answer alone, on both cores; prompts arriving at the
        # prefill worker meanwhile make it give them back between two layers of a step.
        asyncio.run(prefills_during_a_decode(up.base_url))
        deadline = time.monotonic() + 10
        while board.read_bytes()[:2] != b"\x00\x00" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert board.read_bytes()[:2] == b"\x00\x00"
        prefill, decode = (worker_metrics(asyncio.run(scrape(up, name)), "kvmesh:core_lending_total", "event") for name in ("prefill-1", "decode-2"))
        # the first prefill ran while the decode worker had nothing: on both cores
        assert prefill["borrowed"] >= 1, prefill
        assert decode["borrowed"] >= 1 and decode["given_back"] >= 1, decode
        assert prefill["wait_given_up"] == decode["wait_given_up"] == 0, (prefill, decode)
        assert up.stop() == (0, pytest.approx(0, abs=10))
    finally:
        up.cleanup()


async def prefills_during_a_decode(base_url: str) -> None:
    """One streamed answer of 480 tokens; after its first chunk, three other long prompts
    one after another (each a step the prefill worker turns busy for, mid-step for the decoding
    worker nearly always: three make missing it unlikely), then the stream to its end. (160
    tokens were done before the third prompt's answer on an AVX2-only CPU in float32.)"""
    body = {"model": MODEL, "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    first = asyncio.Event()

    async def on_event(events: list[dict]) -> None:
        first.set()

    streaming = asyncio.create_task(stream(base_url, "/v1/completions", {**body, "prompt": "Count slowly:"}, on_event=on_event))
    await asyncio.wait_for(first.wait(), 60)
    for i in range(3):
        prompt = f"Text {i}: " + " ".join(f"word{i}x{j}" for j in range(120))
        await post_text(base_url, "/v1/completions", {**body, "max_tokens": 1, "prompt": prompt})
    assert not streaming.done(), "the decode ended before the prompts came: lengthen it"
    assert len(await streaming) > 300


async def scrape(up: Up, worker: str) -> str:
    """A worker's /metrics (its address from its log's health line)."""
    log = (up.workdir / "logs" / f"{worker}.log").read_text()
    health = re.search(r"health checks on (http://\S+)/health/live", log).group(1)
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(f"{health}/metrics")).text


def worker_metrics(text: str, name: str, label: str | None) -> dict[str | None, float]:
    """One metric's samples in a scrape, by the value of ``label`` (None: unlabelled by it)."""
    found: dict[str | None, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key = line.split(f'{label}="', 1)[1].split('"', 1)[0] if label else None
            found[key] = float(line.rsplit(" ", 1)[1])
    return found
