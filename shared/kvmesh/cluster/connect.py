"""Connections every service opens the same way: NATS that reconnects forever, etcd with a
timeout on every call, both as the service's own user when credentials files are given and
over TLS, trusting the mesh's CA only, when CA files are given."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import nats
import nats.errors

from kvmesh.cluster.etcd_store import EtcdStore
from kvmesh.errors import KvmeshError
from kvmesh.security.credentials import load_credentials
from kvmesh.security.tls import client_context
from kvmesh.settings.mesh import MeshSettings

logger = logging.getLogger(__name__)

RECONNECT_WAIT = 0.5  # seconds between tries of a server
LOG_EVERY = 5.0  # seconds between the warnings while the first connection is tried


async def connect_mesh(mesh: MeshSettings, name: str) -> tuple[nats.NATS, EtcdStore]:
    nc = await connect_nats(mesh, name)
    etcd_user = load_credentials(mesh.etcd_credentials, "etcd") if mesh.etcd_credentials else None
    store = EtcdStore(
        list(mesh.etcd_endpoints), timeout=min(5.0, mesh.request_timeout), credentials=etcd_user, tls_ca=mesh.etcd_tls_ca
    )
    await store.connect()
    return nc, store


async def connect_nats(mesh: MeshSettings, name: str) -> nats.NATS:
    """As the credentials file's user, with replies under that user's own inbox prefix (the
    only one its permissions let it subscribe to); anonymous without one. With a CA file,
    TLS before anything else is said (``tls_handshake_first``: the password never goes to a
    server that only claims not to need TLS) and only a certificate from that CA is accepted.

    The first connection is tried again for ``request_timeout`` seconds (a NATS server that
    starts beside the service), then the service stops with ``MeshUnreachable``; a server
    that refuses the user stops it at once. Once connected, a lost connection is tried again
    for ever (a restarted nats-server is reconnected to, subscriptions and all)."""
    options: dict = {}
    if mesh.nats_credentials:
        user = load_credentials(mesh.nats_credentials, "nats")
        options.update(user=user.user, password=user.password, inbox_prefix=user.inbox_prefix)
    if mesh.nats_tls_ca:
        options.update(tls=client_context(mesh.nats_tls_ca), tls_handshake_first=True)
    errors = _ConnectErrors()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + mesh.request_timeout
    while True:
        try:
            # nats-py's own first connect, told to retry for ever, retries even a refused user
            # and swallows the cancel of Ctrl-C: here each try is one round of the servers
            nc = await nats.connect(
                mesh.nats_url,
                name=name,
                connect_timeout=max(0.1, min(mesh.request_timeout, deadline - loop.time())),
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=RECONNECT_WAIT,
                error_cb=errors.said,
                **options,
            )
            break
        except nats.errors.AuthorizationError as exc:
            raise MeshUnreachable(f"NATS at {_shown(mesh.nats_url)} refused this service's user: {exc}") from None
        except (OSError, nats.errors.Error, TimeoutError):
            pass
        if asyncio.current_task().cancelling():  # type: ignore[union-attr]  # a cancel nats-py swallowed
            raise asyncio.CancelledError
        if loop.time() >= deadline:
            raise MeshUnreachable(
                f"NATS at {_shown(mesh.nats_url)} did not answer within {mesh.request_timeout:g}s "
                f"(--request-timeout): {errors.last}"
            )
        errors.log_now_and_then(mesh.nats_url)
        await asyncio.sleep(RECONNECT_WAIT)
    nc.options["allow_reconnect"] = True  # from now on a lost connection is tried again for ever
    nc.options["max_reconnect_attempts"] = -1
    errors.connected = True
    return nc


class MeshUnreachable(KvmeshError):
    """NATS did not answer a service that was starting, or refused its user."""


class _ConnectErrors:
    """What nats-py says went wrong: kept (and logged now and then) while the first connection
    is tried; once connected, each is a warning (a publish or subscription the server refused)."""

    def __init__(self) -> None:
        self.connected = False
        self.last: Exception | None = None
        self._logged_at = -math.inf

    async def said(self, exc: Exception) -> None:
        if self.connected:
            logger.warning("NATS: %s", exc)
        else:
            self.last = exc

    def log_now_and_then(self, url: str) -> None:
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY:
            self._logged_at = now
            logger.warning("waiting for NATS at %s: %s", _shown(url), self.last)


def _shown(url: str) -> str:
    """The servers' addresses, never a password in them."""
    return ",".join(part.strip().rpartition("@")[2] for part in url.split(","))
