"""Child processes started and stopped by PID: servers, services, whatever kvmesh launches.

Nothing here looks processes up by name: each one is stopped through the handle that
started it (SIGTERM, then SIGKILL after a grace period). A child can be asked to die with
its parent (``parent_death_signal``, Linux's ``PR_SET_PDEATHSIG``), so that even a SIGKILLed
``kvmesh up`` leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from kvmesh.errors import KvmeshError

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
SERVICE_REFUSAL = re.compile(r"kvmesh-[a-z-]+: error: (?P<why>.+)")  # ``run_service``'s one line


class ProcessStartError(KvmeshError):
    """A server or service process did not start or did not become ready."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for servers that cannot pick their own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, loaded in the parent (the child only calls it), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def _die_with_parent(signum: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``signum`` when its parent goes.

    Linux ties this to the parent *thread* that forked the child: spawn from a thread that
    lives as long as the child should (the main thread, or a supervisor's own thread).
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signum)

    return preexec


def describe_exit(returncode: int | None) -> str:
    """``signal 9`` / ``code 1`` / ``running``."""
    if returncode is None:
        return "running"
    if returncode < 0:
        return f"signal {-returncode}"
    return f"code {returncode}"


class ManagedProcess:
    """A child process whose combined output is logged to a file and kept in a short tail."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        parent_death_signal: int | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self.cwd = cwd
        self.parent_death_signal = parent_death_signal
        self._tail: deque[str] = deque(maxlen=200)
        self._total_lines = 0
        self._lines_cond = threading.Condition()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("a", encoding="utf-8", errors="replace")
        try:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                text=True,
                errors="replace",
                start_new_session=True,  # a Ctrl-C in the parent's terminal is ours to forward
                preexec_fn=_die_with_parent(parent_death_signal) if parent_death_signal else None,
            )
        except OSError as exc:
            self._log.close()
            raise ProcessStartError(f"{name}: cannot run {self.argv[0]}: {exc}") from exc
        self._reader = threading.Thread(target=self._read, name=f"{name}-output", daemon=True)
        self._reader.start()
        logger.debug("started %s (pid %d): %s", name, self.pid, " ".join(self.argv))

    def respawn(self, argv: Sequence[str] | None = None) -> ManagedProcess:
        """A new process like this one (same name, log file, environment), started now."""
        return ManagedProcess(
            self.name,
            self.argv if argv is None else argv,
            log_path=self.log_path,
            env=self.env,
            cwd=self.cwd,
            parent_death_signal=self.parent_death_signal,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._log.write(line)
            self._log.flush()
            with self._lines_cond:
                self._tail.append(line.rstrip("\n"))
                self._total_lines += 1
                self._lines_cond.notify_all()
        with self._lines_cond:
            self._lines_cond.notify_all()

    def tail(self, lines: int = 20) -> str:
        with self._lines_cond:
            return "\n".join(list(self._tail)[-lines:])

    def exit_report(self) -> str:
        """Why it exited: a kvmesh service's one-line refusal (``kvmesh-<service>: error: ...``,
        ``kvmesh.service_main.run_service``) as it said it, else its last lines."""
        tail = self.tail()
        refusal = SERVICE_REFUSAL.match(tail.rpartition("\n")[2])
        if refusal:
            return f"{self.name} exited with {self.popen.returncode}: {refusal['why']} (its log: {self.log_path})"
        return f"{self.name} exited with {self.popen.returncode}:\n{tail}"

    def lines_since(self, seen: int) -> tuple[int, list[str]]:
        """The output lines after the first ``seen`` (those still in the tail), and the new count."""
        with self._lines_cond:
            new = min(self._total_lines - seen, len(self._tail))
            return self._total_lines, list(self._tail)[len(self._tail) - new :] if new > 0 else []

    def wait_for_line(self, predicate: Callable[[str], bool], timeout: float) -> str:
        """The first output line (in the kept tail, or to come) that satisfies ``predicate``."""
        deadline = time.monotonic() + timeout
        checked = 0
        with self._lines_cond:
            while True:
                new = self._total_lines - checked
                if new > 0:
                    checked = self._total_lines
                    for line in list(self._tail)[-min(new, len(self._tail)) :]:
                        if predicate(line):
                            return line
                if self.popen.poll() is not None and not self._reader.is_alive():
                    raise ProcessStartError(self.exit_report())
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ProcessStartError(f"{self.name} not ready after {timeout:.0f}s:\n{self.tail()}")
                self._lines_cond.wait(min(remaining, 0.5))

    def is_running(self) -> bool:
        return self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.is_running():
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # exited between the poll and the kill
                pass

    def _finish(self) -> None:
        self._reader.join(2)
        self._log.close()

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL. Returns the exit code."""
        stop_all([self], grace)
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL now: a crash, as the fault tests need it."""
        if self.is_running():
            self.popen.kill()
            self.popen.wait(5)


def stop_all(processes: Iterable[ManagedProcess], grace: float, *, hurry: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM every process at once, wait for them together up to ``grace`` seconds (less
    if ``hurry()`` turns true), SIGKILL whoever is left."""
    processes = list(processes)
    began = time.monotonic()
    for process in processes:
        process.signal(signal.SIGTERM)
    deadline = began + grace
    while any(p.is_running() for p in processes) and time.monotonic() < deadline and not hurry():
        time.sleep(0.02)
    for process in processes:
        if process.is_running():
            logger.warning("%s (pid %d) still running %.1fs after SIGTERM; killing it", process.name, process.pid, grace)
            process.popen.kill()
    for process in processes:
        try:
            process.popen.wait(5)
        except subprocess.TimeoutExpired:  # unkillable (D state): nothing more to do by PID
            logger.error("%s (pid %d) did not die on SIGKILL", process.name, process.pid)
        process._finish()
    if processes:
        logger.debug("stopped %s in %.2fs", ", ".join(p.name for p in processes), time.monotonic() - began)
