"""The supervisor on cheap real children (``sleep`` in Python) and a clock the test moves:
restarts with doubling, capped backoff; the backoff starting over after a long uptime;
nothing restarted after close; stop taking every child down, tier by tier."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from kvmesh.infra.processes import ManagedProcess, ProcessStartError
from kvmesh.infra.supervisor import RestartPolicy, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
STUBBORN = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def spawned(tmp_path):
    """Start children by name; every one started is killed at the end, by PID."""
    started: list[ManagedProcess] = []

    def spawn(name: str, argv: list[str] = SLEEPER) -> ManagedProcess:
        process = ManagedProcess(name, argv, log_path=tmp_path / f"{name}.log")
        started.append(process)
        return process

    yield spawn
    for process in started:
        process.kill()


def make(clock: Clock, **policy) -> tuple[Supervisor, list[str]]:
    lines: list[str] = []
    return Supervisor(RestartPolicy(**policy), report=lines.append, clock=clock), lines


def crash(process: ManagedProcess) -> None:
    process.kill()  # SIGKILL and reaped: the next check sees it gone


def test_a_dead_child_is_restarted_with_doubling_capped_backoff(spawned):
    clock = Clock()
    supervisor, lines = make(clock, initial=0.5, factor=2, maximum=3, reset_after=60)
    supervisor.watch("worker-1", spawned("worker-1"), lambda: spawned("worker-1"))
    delays = []
    for _ in range(5):
        child = supervisor.children["worker-1"]
        first = child.process
        crash(first)
        supervisor.check()  # noticed: no process until the backoff is over
        assert child.process is None and child.restart_at is not None
        delay = child.restart_at - clock.now
        delays.append(delay)
        clock.now += delay - 0.01
        supervisor.check()
        assert child.process is None
        clock.now += 0.01
        supervisor.check()
        assert child.process is not None and child.process.is_running() and child.process.pid != first.pid
        clock.now += 1  # up for a second: too short to reset the backoff
    assert delays == [0.5, 1, 2, 3, 3]
    assert lines[0] == "worker-1 exited (signal 9); restarting in 0.5 s (restart 1)"
    assert lines[1] == f"worker-1 restarted (pid {lines[1].split('pid ')[1].rstrip(')')})"
    assert lines[-2] == "worker-1 exited (signal 9); restarting in 3 s (restart 5)"
    assert supervisor.pids() == {"worker-1": supervisor.children["worker-1"].process.pid}


def test_the_backoff_starts_over_once_the_child_stayed_up(spawned):
    clock = Clock()
    supervisor, lines = make(clock, initial=0.5, factor=2, maximum=30, reset_after=10)
    supervisor.watch("router", spawned("router"), lambda: spawned("router"))
    child = supervisor.children["router"]
    for expected in (0.5, 1, 2):  # dying young: the wait doubles
        crash(child.process)
        supervisor.check()
        assert child.restart_at - clock.now == expected
        clock.now = child.restart_at
        supervisor.check()
        clock.now += 9.9
    clock.now += 0.1  # now up 10 s: the next death waits 0.5 s again
    crash(child.process)
    supervisor.check()
    assert child.restart_at - clock.now == 0.5
    assert lines[-1] == "router exited (signal 9); restarting in 0.5 s (restart 4)"


def test_exit_codes_are_reported_and_on_exit_runs_even_when_it_fails(spawned):
    clock = Clock()
    supervisor, lines = make(clock)
    seen = []

    def on_exit(child):
        seen.append(child.name)
        raise RuntimeError("etcd is down")  # best effort: the restart still comes

    supervisor.watch("kv-metadata", spawned("kv-metadata", [sys.executable, "-c", "raise SystemExit(3)"]),
                     lambda: spawned("kv-metadata"), on_exit=on_exit)  # fmt: skip
    supervisor.children["kv-metadata"].process.popen.wait(10)
    supervisor.check()
    assert seen == ["kv-metadata"]
    assert lines == ["kv-metadata exited (code 3); restarting in 0.5 s (restart 1)"]
    clock.now += 0.5
    supervisor.check()
    assert supervisor.children["kv-metadata"].process.is_running()


def test_a_restart_that_cannot_start_is_tried_again_later(spawned):
    clock = Clock()
    supervisor, lines = make(clock, initial=0.5, factor=2)
    attempts = []

    def respawn():
        attempts.append(clock.now)
        if len(attempts) == 1:
            raise ProcessStartError("nats-server: cannot run /gone: No such file")
        return spawned("nats-server")

    supervisor.watch("nats-server", spawned("nats-server"), respawn)
    crash(supervisor.children["nats-server"].process)
    supervisor.check()
    clock.now += 0.5
    supervisor.check()
    assert "could not be started" in lines[-1] and "retrying in 1 s" in lines[-1]
    clock.now += 1
    supervisor.check()
    assert attempts == [100.5, 101.5]
    assert supervisor.children["nats-server"].process.is_running()


def test_nothing_is_restarted_after_close(spawned):
    clock = Clock()
    supervisor, lines = make(clock)
    supervisor.watch("decode-2", spawned("decode-2"), lambda: spawned("decode-2"))
    crash(supervisor.children["decode-2"].process)
    supervisor.check()  # a restart is due in 0.5 s ...
    supervisor.close()  # ... but the mesh is stopping
    clock.now += 60
    supervisor.check()
    assert supervisor.children["decode-2"].process is None
    assert supervisor.pids() == {}
    assert len(lines) == 1


def test_a_restarted_child_is_reported_back_once_it_says_it_is_ready(spawned):
    clock = Clock()
    supervisor, lines = make(clock, initial=0)
    ready_child = [sys.executable, "-c", "import time; time.sleep(0.2); print('worker w ready', flush=True); time.sleep(60)"]
    supervisor.watch("w", spawned("w"), lambda: spawned("w", ready_child), ready=lambda line: "worker w ready" in line)
    crash(supervisor.children["w"].process)
    supervisor.check()  # exited, and restarted at once (initial=0)
    process = supervisor.children["w"].process
    assert lines[-1] == f"w restarted (pid {process.pid})"
    process.wait_for_line(lambda line: "ready" in line, timeout=10)
    supervisor.check()
    supervisor.check()
    assert lines[-1] == f"w is back (pid {process.pid})"
    assert sum("is back" in line for line in lines) == 1


def test_stop_takes_every_child_down_tier_by_tier(spawned, tmp_path):
    """Tier 0 first (here one that ignores SIGTERM: killed after the 1 s grace), then tier 1
    together (each takes 0.6 s to exit); after stop nothing runs and nothing comes back."""
    marker = tmp_path / "term-time"
    records_term = [
        sys.executable, "-c",
        "import signal, sys, time\n"
        "def on_term(*_):\n"
        f"    open({str(marker)!r}, 'a').write(f'{{time.time()}}\\n'); time.sleep(0.6); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n",
    ]  # fmt: skip
    clock = Clock()
    supervisor, _ = make(clock)
    first = spawned("router", STUBBORN)
    workers = [spawned(f"worker-{i}", records_term) for i in range(3)]
    supervisor.watch("router", first, lambda: spawned("router"), tier=0)
    for process in workers:
        supervisor.watch(process.name, process, lambda: spawned("again"), tier=1)
    for process in (first, *workers):
        process.wait_for_line(lambda line: line == "up", timeout=20)
    began = time.time()
    supervisor.stop(grace=1.0)
    took = time.time() - began
    assert first.popen.returncode == -signal.SIGKILL
    assert [w.popen.returncode for w in workers] == [0, 0, 0]
    terms = [float(t) for t in marker.read_text().split()]
    assert len(terms) == 3 and min(terms) >= began + 1.0  # tier 1 was asked only after tier 0 was gone
    assert took < 1.0 + 0.6 + 0.7  # the three of tier 1 (0.6 s each) stopped together, not one after another
    clock.now += 60
    supervisor.check()
    assert all(c.process is None or not c.process.is_running() for c in supervisor.children.values())


def test_the_supervisor_thread_restarts_on_its_own(spawned):
    supervisor, lines = make(time.monotonic, initial=0.05)
    supervisor.interval = 0.02
    first = spawned("prefill-1")
    supervisor.watch("prefill-1", first, lambda: spawned("prefill-1"))
    supervisor.start()
    try:
        crash(first)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any("restarted" in line for line in lines):
            time.sleep(0.02)
        assert supervisor.children["prefill-1"].process.is_running()
        assert supervisor.children["prefill-1"].process.pid != first.pid
    finally:
        supervisor.stop(grace=2)
    assert not supervisor.children["prefill-1"].process.is_running()
