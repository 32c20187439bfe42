"""etcd users of one mesh and the keys each may read and write (one role per user).

A worker reads ``workers/`` and writes only its own record, its own identity slot
(``slots/<role>/<id>``), its own ``pins/<id>/`` and its own ``blocks/<id>/`` (mirrored there under its lease by kv-metadata);
kv-metadata writes ``blocks/`` and its own record; routers read ``workers/``. ``root`` (etcd's
own all-powerful user) sets auth up and deletes dead workers' records for the supervisor.

Not enforceable in etcd: leases are not owned, so anyone authenticated may grant a lease or
keep any lease alive (a key's lease can be kept from expiring by another user).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvmesh.protocol import Keys

Permission = Literal["READ", "WRITE", "READWRITE"]
ROOT = "root"


@dataclass(slots=True, frozen=True)
class Grant:
    key: str
    permission: Permission
    prefix: bool = False  # every key under ``key``, which ends with "/" (else "workers/a" covers "workers/ab")

    def __post_init__(self) -> None:
        if self.prefix and not self.key.endswith("/"):
            raise ValueError(f"a prefix grant ends with '/': {self.key!r}")


def worker_grants(keys: Keys, role: str, worker_id: str) -> tuple[Grant, ...]:
    grants = [
        Grant(keys.workers(), "READ", prefix=True),
        Grant(keys.worker(role, worker_id), "READWRITE"),
        # kv-metadata mirrors the worker's blocks under the worker's lease, and etcd lets a user
        # revoke a lease (at drain) only if it may write every key on it.
        Grant(keys.blocks(worker_id), "READWRITE", prefix=True),
        # its own identity slot only (``kvmesh.cluster.identity_slots``): a replica claims the
        # identity by creating it, logged in as that identity, so it cannot take another's
        Grant(keys.slot(role, worker_id), "READWRITE"),
    ]
    if role == "prefill":
        grants.append(Grant(keys.pins(worker_id), "READWRITE", prefix=True))
    return tuple(grants)


def kv_metadata_grants(keys: Keys, service_id: str) -> tuple[Grant, ...]:
    return (
        Grant(keys.workers(), "READ", prefix=True),
        Grant(keys.worker("kv-metadata", service_id), "READWRITE"),
        Grant(keys.blocks(), "READWRITE", prefix=True),
    )


def router_grants(keys: Keys) -> tuple[Grant, ...]:
    return (Grant(keys.workers(), "READ", prefix=True),)
