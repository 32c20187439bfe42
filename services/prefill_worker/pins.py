"""Pins: a finished prefill's blocks, held until the decode side pulls them.

Each pin is an etcd key under a lease of its own. The decode side releases it after its
pull (a NATS message, which also counts the bytes, and the lease revoked); if the decode
side dies the lease expires and the watch here frees the blocks. A local deadline frees
them too if etcd itself is unreachable. Whatever happens, the blocks are freed once.

The etcd write never comes before the reply to the router (two etcd round trips would
otherwise sit in every request's time to first token), and it waits until the pin has been
held ``write_delay`` seconds (``--pin-write-delay``, 1 s by default; 0: beside the reply).
Most pulls come within milliseconds of the reply, and a key written and revoked in that time
guards nothing the local deadline does not, while its three etcd writes (lease, key, revoke:
a raft round and a WAL sync each) take the CPU that the first token's way back to the router
and the pull need. Until the key lands, the local deadline alone guards the blocks, as it
does while etcd is unreachable.

Each pin has a random token, made with it and handed out only in the KV handle (or the
lend reply): a release must carry it (compared in constant time), so a worker can release
only the pins of the handles it was given. A lend's pin also names its borrower, so a
lender can cap what it holds for each peer.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvmesh.cluster.etcd_store import ClusterError, EtcdStore
from kvmesh.tasks import pause

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Pin:
    request_id: str
    num_bytes: int
    deadline: float
    token: str = ""  # the secret a release must carry
    borrower: str | None = None  # a lend's: the peer it is held for
    num_blocks: int = 0
    lease_id: int | None = None  # set once the etcd key is written


class PinTable:
    def __init__(
        self,
        store: EtcdStore,
        prefix: str,
        ttl: int,
        release_blocks: Callable[[str], Awaitable[bool]],
        *,
        write_delay: float,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.ttl = ttl
        self.write_delay = write_delay
        self._release_blocks = release_blocks
        self.pins: dict[str, Pin] = {}
        self.released = 0
        self.expired = 0
        self.unwritten = 0  # pins released before their etcd key was due
        self._tasks: list[asyncio.Task] = []
        self._writes: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self.pins)

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._watch_expiry(), name="pin-watch"),
            asyncio.create_task(self._local_deadlines(), name="pin-deadlines"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for request_id in list(self.pins):
            await self.release(request_id, reason="shutdown")

    def pin(self, request_id: str, value: bytes, num_bytes: int, *, borrower: str | None = None, num_blocks: int = 0) -> Pin:
        """Hold a request's blocks from now; the etcd key follows in the background, if the
        pin is still held ``write_delay`` seconds from now."""
        pin = Pin(
            request_id, num_bytes, time.monotonic() + self.ttl + 5, secrets.token_urlsafe(16), borrower, num_blocks
        )
        self.pins[request_id] = pin
        task = asyncio.create_task(self._write(pin, value), name=f"pin {request_id}")
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return pin

    async def _write(self, pin: Pin, value: bytes) -> None:
        if self.write_delay > 0:
            await asyncio.sleep(self.write_delay)
        if self.pins.get(pin.request_id) is not pin:  # pulled (or otherwise released) already
            self.unwritten += 1
            return
        try:
            lease_id = await self.store.grant(self.ttl)
            await self.store.put(self.prefix + pin.request_id, value, lease=lease_id)
        except ClusterError as exc:
            logger.warning("pin of %s not written to etcd (%s); the local deadline guards it", pin.request_id, exc)
            return
        pin.lease_id = lease_id
        if self.pins.get(pin.request_id) is not pin:  # released while the write was in flight
            await self._revoke(lease_id)

    def lent_to(self, borrower: str) -> int:
        """Blocks held now for ``borrower``'s pulls."""
        return sum(pin.num_blocks for pin in self.pins.values() if pin.borrower == borrower)

    async def release_with_token(self, request_id: str, token: str, *, reason: str) -> Pin | None:
        """``release``, if ``token`` is the pin's own; else nothing happens (and a line says so)."""
        pin = self.pins.get(request_id)
        if pin is None:
            return None
        if not hmac.compare_digest(pin.token.encode(), token.encode()):
            logger.warning("refused a release of %s: wrong pin token", request_id)
            return None
        return await self.release(request_id, reason=reason)

    async def release(self, request_id: str, *, reason: str) -> Pin | None:
        """Free a pin's blocks (once) and drop its lease; ``None`` if it was already gone."""
        pin = self.pins.pop(request_id, None)
        if pin is None:
            return None
        await self._release_blocks(request_id)
        if reason == "pulled":
            self.released += 1
        else:
            self.expired += 1
            logger.info("pin of %s released: %s", request_id, reason)
        if reason != "lease expired" and pin.lease_id is not None:
            task = asyncio.create_task(self._revoke(pin.lease_id))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)
        return pin

    async def _revoke(self, lease_id: int) -> None:
        try:
            await self.store.revoke(lease_id)
        except ClusterError as exc:
            logger.debug("revoking pin lease %x failed: %s", lease_id, exc)

    async def _watch_expiry(self) -> None:
        while True:
            try:
                async for event in self.store.watch_prefix(self.prefix):
                    if event.kind == "delete":
                        await self.release(event.key[len(self.prefix) :], reason="lease expired")
            except ClusterError as exc:
                logger.warning("pin watch broke (%s); retrying", exc)
            await pause(0.5)

    async def _local_deadlines(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for request_id in [r for r, pin in self.pins.items() if pin.deadline < now]:
                await self.release(request_id, reason="deadline passed")
