"""Child processes started and stopped by PID: servers, services, whatever kvmesh launches.

Nothing here looks processes up by name: each one is stopped through the handle that
started it (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from kvmesh.errors import KvmeshError

logger = logging.getLogger(__name__)


class ProcessStartError(KvmeshError):
    """A server or service process did not start or did not become ready."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for servers that cannot pick their own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._tail: deque[str] = deque(maxlen=200)
        self._total_lines = 0
        self._lines_cond = threading.Condition()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("a", encoding="utf-8", errors="replace")
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
        )
        self._reader = threading.Thread(target=self._read, name=f"{name}-output", daemon=True)
        self._reader.start()
        logger.debug("started %s (pid %d): %s", name, self.pid, " ".join(self.argv))

    @property
    def pid(self) -> int:
        return self.popen.pid

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
                    raise ProcessStartError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ProcessStartError(f"{self.name} not ready after {timeout:.0f}s:\n{self.tail()}")
                self._lines_cond.wait(min(remaining, 0.5))

    def is_running(self) -> bool:
        return self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.is_running():
            os.kill(self.pid, signum)

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL. Returns the exit code."""
        if self.is_running():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %d) ignored SIGTERM for %.0fs; killing it", self.name, self.pid, grace)
                self.popen.kill()
                self.popen.wait(5)
        self._reader.join(2)
        self._log.close()
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL now: a crash, as the fault tests need it."""
        if self.is_running():
            self.popen.kill()
            self.popen.wait(5)
