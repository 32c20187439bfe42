"""The etcd client of kvmesh: every call has a timeout; transport errors become ``ClusterError``.

Built on ``etcd3aio`` (asyncio, grpc.aio): ``etcd3`` 0.12 no longer imports beside protobuf 4+.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from etcd3aio import Etcd3Client, EtcdError, prefix_range_end
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService
from etcd3aio.watch import WatchService

from kvmesh.errors import KvmeshError

logger = logging.getLogger(__name__)


class ClusterError(KvmeshError):
    """etcd could not be reached or refused an operation."""


@dataclass(slots=True, frozen=True)
class KeyValue:
    key: str
    value: bytes
    lease: int
    mod_revision: int


@dataclass(slots=True, frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    key: str
    value: bytes
    lease: int = 0


MAX_TXN_OPS = 128

_TRANSPORT_ERRORS = (EtcdError, grpc.aio.AioRpcError, asyncio.TimeoutError, OSError)


class EtcdStore:
    def __init__(self, endpoints: list[str], *, timeout: float = 5.0) -> None:
        self.endpoints = endpoints
        self.timeout = timeout
        self._client = Etcd3Client(endpoints, watch_max_reconnect_backoff_seconds=1.0)
        self._connected = False

    async def connect(self) -> None:
        await self._client.connect()
        self._connected = True

    async def close(self) -> None:
        if self._connected:
            await self._client.close()
            self._connected = False

    async def __aenter__(self) -> EtcdStore:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def _kv(self) -> KVService:
        if self._client.kv is None:
            raise ClusterError("etcd is not connected")
        return self._client.kv

    @property
    def _lease(self) -> LeaseService:
        if self._client.lease is None:
            raise ClusterError("etcd is not connected")
        return self._client.lease

    @property
    def _watch(self) -> WatchService:
        if self._client.watch is None:
            raise ClusterError("etcd is not connected")
        return self._client.watch

    async def _call(self, what: str, awaitable):
        try:
            return await asyncio.wait_for(awaitable, self.timeout)
        except _TRANSPORT_ERRORS as exc:
            raise ClusterError(f"etcd {what} failed: {exc!r}") from exc

    # -- keys ----------------------------------------------------------------------------
    async def put(self, key: str, value: bytes, *, lease: int = 0) -> None:
        await self._call(f"put {key}", self._kv.put(key, value, lease=lease, timeout=self.timeout))

    async def get(self, key: str) -> KeyValue | None:
        response = await self._call(f"get {key}", self._kv.get(key, timeout=self.timeout))
        return _key_value(response.kvs[0]) if response.kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the store revision they were read at."""
        response = await self._call(
            f"get {prefix}*", self._kv.get(prefix, prefix_range_end(prefix), timeout=self.timeout)
        )
        return [_key_value(kv) for kv in response.kvs], response.header.revision

    async def delete(self, key: str) -> bool:
        response = await self._call(f"delete {key}", self._kv.delete(key, timeout=self.timeout))
        return response.deleted > 0

    async def delete_prefix(self, prefix: str) -> int:
        response = await self._call(
            f"delete {prefix}*", self._kv.delete(prefix, prefix_range_end(prefix), timeout=self.timeout)
        )
        return response.deleted

    async def write_batch(self, puts: list[tuple[str, bytes, int]], deletes: list[str]) -> None:
        """Puts (key, value, lease) and deletes in transactions of at most ``MAX_TXN_OPS``
        (etcd's default limit): one round trip per transaction."""
        kv = self._kv
        ops = [kv.txn_op_put(key, value, lease=lease) for key, value, lease in puts]
        ops += [kv.txn_op_delete(key) for key in deletes]
        for start in range(0, len(ops), MAX_TXN_OPS):
            chunk = ops[start : start + MAX_TXN_OPS]
            await self._call(f"txn of {len(chunk)} ops", kv.txn(compare=[], success=chunk, failure=[], timeout=self.timeout))

    # -- leases --------------------------------------------------------------------------
    async def grant(self, ttl: int) -> int:
        response = await self._call("lease grant", self._lease.grant(ttl, timeout=self.timeout))
        return response.ID

    async def revoke(self, lease_id: int) -> None:
        try:
            await self._call("lease revoke", self._lease.revoke(lease_id, timeout=self.timeout))
        except ClusterError as exc:
            if "not found" not in str(exc):
                raise

    async def refresh(self, lease_id: int) -> int:
        """One keepalive; returns the lease's new TTL, 0 when the lease is gone."""

        async def once() -> int:
            call = self._lease.keep_alive(lease_id)
            try:
                async for response in call:
                    return response.TTL
                return 0
            finally:
                call.cancel()

        return await self._call("lease keepalive", once())

    # -- watch ---------------------------------------------------------------------------
    async def watch_prefix(self, prefix: str, start_revision: int = 0) -> AsyncIterator[WatchEvent]:
        """Events under ``prefix`` from ``start_revision`` (reconnects on transient errors)."""
        stream = self._watch.watch(prefix, prefix_range_end(prefix), start_revision=start_revision)
        try:
            async for response in stream:
                for event in response.events:
                    kind = "delete" if event.type == 1 else "put"
                    yield WatchEvent(kind, event.kv.key.decode(), event.kv.value, event.kv.lease)
        except _TRANSPORT_ERRORS as exc:
            raise ClusterError(f"etcd watch {prefix} failed: {exc!r}") from exc
        finally:
            await stream.aclose()  # type: ignore[attr-defined]  # etcd3aio's watch is an async generator


def _key_value(kv) -> KeyValue:
    return KeyValue(kv.key.decode(), kv.value, kv.lease, kv.mod_revision)
