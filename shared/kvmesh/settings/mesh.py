"""Where the mesh is (NATS, etcd, the namespace, credentials, TLS): the settings every
service has, and their flags (``add_mesh_args``)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvmesh.protocol import Subjects
from kvmesh.settings import env
from kvmesh.settings.flags import SettingsParser
from kvmesh.settings.values import positive_number
from kvmesh.settings.files import settings_text


@dataclass(slots=True, frozen=True)
class MeshSettings:
    """Where the mesh is: NATS, etcd, the namespace. No defaults: a missing one fails at start."""

    nats_url: str
    etcd_endpoints: tuple[str, ...]
    namespace: str = "default"
    request_timeout: float = 30.0  # seconds for any single network wait (connect, ack, query)
    request_deadline: float = 1800.0  # seconds a whole request may take, retries included
    silence_timeout: float = 5.0  # a worker working on a request says so at least this often
    heartbeat_interval: float = 0.5  # how often workers say so (``Progress``)
    # Paths of credentials files (``kvmesh.security.credentials``; one file may hold both);
    # None: connect anonymously, as to a mesh without auth.
    nats_credentials: str | None = None
    etcd_credentials: str | None = None
    # Paths of the CA certificates the NATS and etcd servers' certificates are signed by
    # (``kvmesh.security.tls``); given: TLS only, trusting that CA alone. None: plaintext.
    nats_tls_ca: str | None = None
    etcd_tls_ca: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval < self.silence_timeout:
            raise ValueError("the heartbeat interval must be positive and shorter than the silence timeout")
        for name in ("request_timeout", "request_deadline"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value:g}")
        Subjects(self.namespace)  # one NATS token
        for url in self.nats_url.split(","):
            _check_address(url.strip(), "--nats-url", schemes=("nats", "tls"), port_optional=True)  # 4222
        for endpoint in self.etcd_endpoints:
            _check_address(endpoint, "--etcd", schemes=("http", "https"))


def _check_address(address: str, flag: str, schemes: tuple[str, ...], port_optional: bool = False) -> None:
    """``[scheme://][user:password@]host[:port]`` with a known scheme and a port in 1..65535
    (required unless ``port_optional``)."""
    parts = urlsplit(address if "://" in address else f"{schemes[0]}://{address}")
    try:
        port = parts.port
        bad_port = (port is None and not port_optional) or (port is not None and not 0 < port < 65536)
    except ValueError:
        bad_port = True
    if parts.scheme not in schemes or not parts.hostname or bad_port:
        shown = address.rpartition("@")[2]  # never a password
        port_text = "[:port]" if port_optional else ":port"
        raise ValueError(f"{flag}: {shown!r} is not [{'|'.join(f'{s}://' for s in schemes)}]host{port_text}")


def add_mesh_args(parser: SettingsParser) -> None:
    option = parser.option
    option("--nats-url", env=env.NATS_URL, help="NATS server URL (KVMESH_NATS_URL)")
    option("--etcd", env=env.ETCD_ENDPOINTS, help="etcd endpoints host:port[,host:port] (KVMESH_ETCD_ENDPOINTS)")
    option("--namespace", env=env.NAMESPACE, default="default", help="mesh namespace (KVMESH_NAMESPACE)")
    option(
        "--request-timeout", env=env.REQUEST_TIMEOUT, type=positive_number, default=30.0,
        help="seconds for any single network wait: connect (a service that cannot reach NATS this long at start stops), ack, query (KVMESH_REQUEST_TIMEOUT)",
    )  # fmt: skip
    option(
        "--request-deadline", env=env.REQUEST_DEADLINE, type=positive_number, default=1800.0,
        help="seconds a whole request may take, retries included (KVMESH_REQUEST_DEADLINE)",
    )  # fmt: skip
    option(
        "--silence-timeout", env=env.SILENCE_TIMEOUT, type=positive_number, default=5.0,
        help="a worker silent this long about a request is given up on (KVMESH_SILENCE_TIMEOUT)",
    )  # fmt: skip
    option(
        "--heartbeat-interval", env=env.HEARTBEAT_INTERVAL, type=positive_number, default=0.5,
        help="seconds between a worker's progress messages for a request (KVMESH_HEARTBEAT_INTERVAL)",
    )  # fmt: skip
    option(
        "--nats-credentials", env=env.NATS_CREDENTIALS, metavar="FILE",
        help="credentials file (mode 0600) with the NATS user and password (KVMESH_NATS_CREDENTIALS)",
    )  # fmt: skip
    option(
        "--etcd-credentials", env=env.ETCD_CREDENTIALS, metavar="FILE",
        help="credentials file (mode 0600) with the etcd user and password (KVMESH_ETCD_CREDENTIALS)",
    )  # fmt: skip
    option(
        "--nats-tls-ca", env=env.NATS_TLS_CA, metavar="FILE",
        help="CA certificate of the NATS server: TLS (handshake first), trusting this CA only (KVMESH_NATS_TLS_CA)",
    )  # fmt: skip
    option(
        "--etcd-tls-ca", env=env.ETCD_TLS_CA, metavar="FILE",
        help="CA certificate of the etcd servers: TLS, trusting this CA only (KVMESH_ETCD_TLS_CA)",
    )  # fmt: skip
    option(
        "--require-tls", env=env.REQUIRE_TLS, action="store_true", default=False, from_env=lambda text: text == "1",
        help="refuse to start without --nats-tls-ca and --etcd-tls-ca and both credentials files (KVMESH_REQUIRE_TLS=1)",
    )  # fmt: skip


def mesh_settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> MeshSettings:
    if not args.nats_url:
        parser.error("--nats-url (or KVMESH_NATS_URL) is required")
    if not args.etcd:
        parser.error("--etcd (or KVMESH_ETCD_ENDPOINTS) is required")
    try:
        settings = MeshSettings(
            nats_url=args.nats_url,
            etcd_endpoints=tuple(e.strip() for e in args.etcd.split(",") if e.strip()),
            namespace=args.namespace,
            request_timeout=args.request_timeout,
            request_deadline=args.request_deadline,
            silence_timeout=args.silence_timeout,
            heartbeat_interval=args.heartbeat_interval,
            nats_credentials=_checked_credentials(args.nats_credentials, "nats", parser),
            etcd_credentials=_checked_credentials(args.etcd_credentials, "etcd", parser),
            nats_tls_ca=_checked_ca(args.nats_tls_ca, "--nats-tls-ca", parser),
            etcd_tls_ca=_checked_ca(args.etcd_tls_ca, "--etcd-tls-ca", parser),
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.require_tls:
        missing = [
            flag for flag, value in (
                ("--nats-tls-ca", settings.nats_tls_ca), ("--etcd-tls-ca", settings.etcd_tls_ca),
                ("--nats-credentials", settings.nats_credentials), ("--etcd-credentials", settings.etcd_credentials),
            ) if not value
        ]  # fmt: skip
        if missing:
            parser.error(f"--require-tls (KVMESH_REQUIRE_TLS): {', '.join(missing)} missing")
    return settings


def _checked_ca(path: str | None, flag: str, parser: argparse.ArgumentParser) -> str | None:
    """A CA certificate file that is there and is PEM: fail at start, not at the first connect."""
    if not path:
        return None
    try:
        text = settings_text(path)
    except OSError as exc:
        parser.error(f"{flag} {path}: {exc.strerror or exc}")
    if "-----BEGIN CERTIFICATE-----" not in text:
        parser.error(f"{flag} {path}: not a PEM certificate")
    return path


def _checked_credentials(path: str | None, section: str, parser: argparse.ArgumentParser) -> str | None:
    """A credentials file that is there, private and has ``section``: fail at start, not later."""
    from kvmesh.security.credentials import CredentialsError, load_credentials

    if path:
        try:
            load_credentials(path, section)
        except CredentialsError as exc:
            parser.error(str(exc))
    return path or None
