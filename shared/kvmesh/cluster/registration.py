"""A worker's record in etcd under a lease it keeps alive; re-registered if the lease is lost.

If the worker dies, nobody refreshes the lease and etcd deletes the record when the TTL
runs out. If etcd restarts or the worker is cut off for longer than the TTL, the next
refresh finds the lease gone and the worker registers again under a new one, but only
where the key is absent: by then a record there is another holder's (a replica that took
the identity meanwhile, ``kvmesh.cluster.identity_slots``), and overwriting it would let
this worker's later revoke delete that holder's record.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvmesh.cluster.etcd_store import ClusterError, EtcdStore
from kvmesh.tasks import cancel_and_wait, pause

logger = logging.getLogger(__name__)


class LeasedKey:
    def __init__(self, store: EtcdStore, key: str, value: bytes, *, ttl: int, replace: bool = True) -> None:
        """``replace``: at start, a record already there (this worker's previous process's) is
        replaced; without, it is another holder's and the start fails (``ClusterError``)."""
        if ttl < 1:
            raise ValueError("a lease TTL is at least 1 second")
        self.store = store
        self.key = key
        self.value = value
        self.ttl = ttl
        self.replace = replace
        self.lease_id: int | None = None
        self.registrations = 0
        self.last_confirmed: float | None = None  # monotonic time etcd last confirmed the lease
        self._task: asyncio.Task | None = None

    @property
    def confirmed(self) -> bool:
        """etcd confirmed the lease within its TTL: others see this key now."""
        return self.last_confirmed is not None and time.monotonic() - self.last_confirmed < self.ttl

    async def start(self) -> None:
        await self._register()
        self._task = asyncio.create_task(self._keep_alive(), name=f"keepalive {self.key}")

    async def _register(self) -> None:
        lease_id = await self.store.grant(self.ttl)
        starting = self.lease_id is None
        if starting and self.replace:  # a record left by this worker's previous process is replaced
            await self.store.put(self.key, self.value, lease=lease_id)
        elif not await self.store.create(self.key, self.value, lease=lease_id):
            await self.store.revoke(lease_id)
            if starting:
                raise ClusterError(f"{self.key} is registered by another holder")
            self.lease_id = 0  # lost, not ours to revoke; tried again at the next refresh
            logger.warning("%s is held by another registration now; not overwriting it", self.key)
            return
        self.lease_id = lease_id
        self.registrations += 1
        self.last_confirmed = time.monotonic()
        logger.info("registered %s (lease %x, ttl %ds)", self.key, lease_id, self.ttl)

    async def _keep_alive(self) -> None:
        interval = max(self.ttl / 3, 0.2)
        while True:
            await pause(interval)
            try:
                if not self.lease_id or await self.store.refresh(self.lease_id) <= 0:
                    logger.warning("lease of %s was lost; registering again", self.key)
                    await self._register()
                else:
                    self.last_confirmed = time.monotonic()
            except ClusterError as exc:
                logger.warning("keeping %s alive failed (%s); retrying", self.key, exc)

    async def stop(self, *, revoke: bool = True) -> None:
        """Stop refreshing; with ``revoke`` the key is deleted now instead of at expiry."""
        await cancel_and_wait(self._task)
        self._task = None
        if revoke and self.lease_id:
            try:
                await self.store.revoke(self.lease_id)
            except ClusterError as exc:
                logger.warning("could not revoke the lease of %s: %s", self.key, exc)
            self.lease_id = None
