"""Connections every service opens the same way: NATS that reconnects forever, etcd with a
timeout on every call, both as the service's own user when credentials files are given and
over TLS, trusting the mesh's CA only, when CA files are given."""

from __future__ import annotations

import logging

import nats

from kvmesh.cluster.etcd_store import EtcdStore
from kvmesh.security.credentials import load_credentials
from kvmesh.security.tls import client_context
from kvmesh.settings.mesh import MeshSettings

logger = logging.getLogger(__name__)


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
    server that only claims not to need TLS) and only a certificate from that CA is accepted."""
    options: dict = {}
    if mesh.nats_credentials:
        user = load_credentials(mesh.nats_credentials, "nats")
        options.update(user=user.user, password=user.password, inbox_prefix=user.inbox_prefix)
    if mesh.nats_tls_ca:
        options.update(tls=client_context(mesh.nats_tls_ca), tls_handshake_first=True)
    return await nats.connect(
        mesh.nats_url,
        name=name,
        connect_timeout=mesh.request_timeout,
        max_reconnect_attempts=-1,  # a restarted nats-server is reconnected to, subscriptions and all
        reconnect_time_wait=0.5,
        error_cb=_nats_error,
        **options,
    )


async def _nats_error(exc: Exception) -> None:
    """A publish or subscription the server refused arrives here; the connection stays up."""
    logger.warning("NATS: %s", exc)
