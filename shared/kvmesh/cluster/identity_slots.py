"""Identity slots: replicas of one worker service that share their configuration each run as
an identity of their own.

A worker logs in to NATS and etcd as itself and may publish only its own subjects, so two
processes must never run as one identity. Given a role's credentials files
(``--identity-slots`` / ``KVMESH_IDENTITY_SLOTS``: a folder, whose ``<role>-*.json`` files
are taken, or a comma-separated list of files), a worker claims the first identity no live
worker holds: logged in to etcd as that identity, it creates the identity's slot key
(``Keys.slot``) under a lease of its own, in one transaction that succeeds only if neither
the slot key nor a worker record of that identity exists. Each identity's etcd role lets it
write its own slot key and no other (``etcd_roles.worker_grants``), so a replica can take
only an identity whose password it has, and two claimants of one slot cannot both win.

The claimed identity is the worker's id and its credentials file its NATS and etcd
credentials. A replica that dies stops refreshing the lease and etcd frees the slot within
the lease's TTL; one that stops cleanly revokes it at once. A replica that finds no free slot
logs one line and exits with ``NO_FREE_SLOT_EXIT`` (a supervisor's restart policy tries again
later). A replica cut off from etcd for longer than the TTL claims its slot again if it is
still free; if another replica took it meanwhile, the lost callback ends this one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

from kvmesh.cluster.etcd_store import ClusterError, EtcdStore
from kvmesh.errors import KvmeshError
from kvmesh.protocol import Keys
from kvmesh.security.credentials import CredentialsError, load_credentials
from kvmesh.settings.worker import WorkerSettings
from kvmesh.tasks import cancel_and_wait, pause

logger = logging.getLogger(__name__)

NO_FREE_SLOT_EXIT = 75  # EX_TEMPFAIL: try again later


class SlotError(KvmeshError):
    """No usable identity files were given, or every identity is held by a live worker."""


def slot_files(spec: str, role: str) -> tuple[Path, ...]:
    """The credentials files of ``spec``: a folder's ``<role>-*.json`` files, or a
    comma-separated list of files, in the order of the numbers in their names."""
    spec = spec.strip()
    folder = Path(spec)
    if "," not in spec and folder.is_dir():
        files = list(folder.glob(f"{role}-*.json"))
        if not files:
            raise SlotError(f"identity slots: no {role}-*.json credentials files in {folder}")
    else:
        files = [Path(part.strip()) for part in spec.split(",") if part.strip()]
        missing = [str(f) for f in files if not f.is_file()]
        if not files or missing:
            raise SlotError(f"identity slots: no credentials file at {', '.join(missing) or repr(spec)}")
    return tuple(sorted(files, key=_natural))


def _natural(path: Path) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


class IdentitySlot:
    """A claimed identity: its slot key under a lease this object keeps alive until ``release``."""

    def __init__(
        self, store: EtcdStore, key: str, identity: str, credentials: Path, lease_id: int, ttl: int, value: bytes
    ) -> None:
        self.store, self.key, self.identity, self.credentials = store, key, identity, credentials
        self.lease_id, self.ttl, self.value = lease_id, ttl, value
        self._task: asyncio.Task | None = None

    @classmethod
    async def claim(cls, settings: WorkerSettings) -> IdentitySlot:
        """The first of ``settings.identity_slots`` no live worker holds; ``SlotError`` if none is free."""
        mesh, keys = settings.mesh, Keys(settings.mesh.namespace)
        value = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "claimed_at": time.time()}).encode()
        held, refused = [], []
        for path in map(Path, settings.identity_slots):
            try:
                user = load_credentials(path, "etcd")
                load_credentials(path, "nats")  # the worker will need both
            except CredentialsError as exc:
                refused.append(f"{path.name} ({exc})")
                continue
            store = EtcdStore(
                list(mesh.etcd_endpoints), timeout=min(5.0, mesh.request_timeout), credentials=user, tls_ca=mesh.etcd_tls_ca
            )
            try:
                await store.connect()
            except ClusterError as exc:  # a wrong password, or an identity etcd-auth has not made
                refused.append(f"{user.user} ({exc})")
                continue
            key = keys.slot(settings.role, user.user)
            try:
                lease_id = await store.grant(settings.lease_ttl)
                if await store.create(key, value, lease=lease_id, unless=(keys.worker(settings.role, user.user),)):
                    logger.info("claimed identity %s (slot %s, lease %x, ttl %ds)", user.user, key, lease_id, settings.lease_ttl)
                    return cls(store, key, user.user, path, lease_id, settings.lease_ttl, value)
                await store.revoke(lease_id)
                held.append(user.user)
            except ClusterError as exc:
                refused.append(f"{user.user} ({exc})")
            await store.close()
        raise SlotError(
            f"no free identity slot for this {settings.role} worker: {len(held)} of {len(settings.identity_slots)} "
            f"held by live workers ({', '.join(held) or 'none'})" + (f"; refused: {'; '.join(refused)}" if refused else "")
        )

    def settings(self, settings: WorkerSettings) -> WorkerSettings:
        """``settings`` as this identity: its worker id and credentials."""
        path = str(self.credentials)
        mesh = dataclasses.replace(settings.mesh, nats_credentials=path, etcd_credentials=path)
        return dataclasses.replace(settings, worker_id=self.identity, mesh=mesh)

    def keep(self, on_lost: Callable[[], None]) -> None:
        """Refresh the lease in the background; ``on_lost`` once another replica has the identity."""
        self._task = asyncio.create_task(self._keep_alive(on_lost), name=f"keepalive {self.key}")

    async def _keep_alive(self, on_lost: Callable[[], None]) -> None:
        while True:
            await pause(max(self.ttl / 3, 0.2))
            try:
                if await self.store.refresh(self.lease_id) > 0:
                    continue
                # The lease is gone (etcd restarted, or this worker was cut off past the TTL).
                lease_id = await self.store.grant(self.ttl)
                if not await self.store.create(self.key, self.value, lease=lease_id):
                    await self.store.revoke(lease_id)
                    logger.critical(
                        "identity %s was claimed by another worker while this one was cut off from etcd", self.identity
                    )
                    on_lost()
                    return
                self.lease_id = lease_id
                logger.warning("the lease of identity slot %s was lost; claimed it again (lease %x)", self.key, lease_id)
            except ClusterError as exc:
                logger.warning("keeping identity slot %s failed (%s); retrying", self.key, exc)

    async def release(self) -> None:
        """Free the slot now (the worker has left etcd) and close the connection."""
        await cancel_and_wait(self._task)
        self._task = None
        try:
            await self.store.revoke(self.lease_id)
        except ClusterError as exc:
            logger.warning("could not free identity slot %s (it frees itself within %ds): %s", self.key, self.ttl, exc)
        await self.store.close()
