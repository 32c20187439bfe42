"""Connections every service opens the same way: NATS that reconnects forever, etcd with a
timeout on every call."""

from __future__ import annotations

import nats

from kvmesh.cluster.etcd_store import EtcdStore
from kvmesh.worker.settings import MeshSettings


async def connect_mesh(mesh: MeshSettings, name: str) -> tuple[nats.NATS, EtcdStore]:
    nc = await nats.connect(
        mesh.nats_url,
        name=name,
        connect_timeout=mesh.request_timeout,
        max_reconnect_attempts=-1,  # a restarted nats-server is reconnected to, subscriptions and all
        reconnect_time_wait=0.5,
    )
    store = EtcdStore(list(mesh.etcd_endpoints), timeout=min(5.0, mesh.request_timeout))
    await store.connect()
    return nc, store
