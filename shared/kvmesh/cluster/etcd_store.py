"""The etcd client of kvmesh: every call has a timeout; transport errors become ``ClusterError``.

Built on ``etcd3aio`` (asyncio, grpc.aio): ``etcd3`` 0.12 no longer imports beside protobuf 4+.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from etcd3aio import Etcd3Client, EtcdError, EtcdUnauthenticatedError, prefix_range_end
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService
from etcd3aio.watch import WatchService

from kvmesh.errors import KvmeshError
from kvmesh.security.credentials import UserPassword

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


TOKEN_REFRESH = 60.0  # seconds between re-authentications; etcd's tokens last 300 s by default


class EtcdStore:
    """With ``credentials`` (or ``user:password@host:port`` endpoints, for tools and tests)
    the store authenticates at connect, renews its token every ``token_refresh`` seconds,
    and authenticates again when etcd says the token is no longer valid. With ``tls_ca`` (a
    CA certificate file) it speaks TLS only and trusts only that CA; the server's certificate
    must name the endpoint's host (an IP address or a DNS name)."""

    def __init__(
        self,
        endpoints: list[str],
        *,
        timeout: float = 5.0,
        credentials: UserPassword | None = None,
        token_refresh: float = TOKEN_REFRESH,
        tls_ca: str | Path | None = None,
    ) -> None:
        self.endpoints, found = _split_userinfo(_strip_scheme(endpoints, tls_ca))
        self.credentials = credentials or found
        self.timeout = timeout
        self.token_refresh = token_refresh
        ca_cert = Path(tls_ca).read_bytes() if tls_ca else None  # None: etcd3aio's plaintext channel
        # Several endpoints share one gRPC channel, whose name gRPC cannot take from the list:
        # the first endpoint's host is checked against every member's certificate.
        server_name = self.endpoints[0].rpartition(":")[0] if ca_cert and len(self.endpoints) > 1 else None
        self._client = Etcd3Client(
            self.endpoints, watch_max_reconnect_backoff_seconds=1.0, ca_cert=ca_cert, tls_server_name=server_name
        )
        target = _dns_target(self.endpoints)
        if target is not None:
            # etcd3aio names its channel ``ipv4:<endpoints>``, which takes addresses only: a
            # host name (``etcd:2379`` in the deployment files) goes through gRPC's resolver,
            # which also makes it the name the server's certificate is checked against.
            self._client._manager.target = target
        self._connected = False
        self._auth_lock = asyncio.Lock()
        self._token_generation = 0  # counts authentications, so concurrent failures renew once
        self._refresher: asyncio.Task | None = None

    async def connect(self) -> None:
        await self._client.connect()
        self._connected = True
        if self.credentials is not None:
            try:
                await self._authenticate(self._token_generation)
            except ClusterError:
                await self.close()
                raise
            self._refresher = asyncio.create_task(self._refresh_token(), name="etcd token refresh")

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            self._refresher = None
        if self._connected:
            await self._client.close()
            self._connected = False

    async def _authenticate(self, generation: int) -> None:
        """A new token, unless another call already got one since ``generation``."""
        assert self.credentials is not None
        async with self._auth_lock:
            if generation != self._token_generation:
                return
            if self._client.auth is None:
                raise ClusterError("etcd is not connected")
            try:
                async with asyncio.timeout(self.timeout):
                    response = await self._client.auth.authenticate(self.credentials.user, self.credentials.password)
            except _TRANSPORT_ERRORS as exc:
                raise ClusterError(f"etcd authentication as {self.credentials.user} failed: {exc!r}") from exc
            self._client.set_token(response.token)
            self._token_generation += 1

    async def _refresh_token(self) -> None:
        while True:
            await asyncio.sleep(self.token_refresh)
            try:
                await self._authenticate(self._token_generation)
            except ClusterError as exc:
                logger.warning("%s; retrying on the next call", exc)

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

    async def _call(self, what: str, make: Callable[[], Awaitable]):
        """``make()`` under the timeout; made once more after re-authenticating when the
        token was refused (it expired, or etcd restarted and forgot it)."""
        generation = self._token_generation
        try:
            return await self._timed(make)
        except EtcdUnauthenticatedError as exc:
            if self.credentials is None:
                raise ClusterError(f"etcd {what} failed: {exc!r}") from exc
            logger.info("etcd refused the token of %s (%s); authenticating again", self.credentials.user, exc)
        except _TRANSPORT_ERRORS as exc:
            raise ClusterError(f"etcd {what} failed: {exc!r}") from exc
        await self._authenticate(generation)
        try:
            return await self._timed(make)
        except _TRANSPORT_ERRORS as exc:
            raise ClusterError(f"etcd {what} failed: {exc!r}") from exc

    async def _timed(self, make: Callable[[], Awaitable]):
        """``make()`` awaited in this task under the timeout. Not ``asyncio.wait_for``: on
        Python 3.11 it runs the call in a task of its own and, when the caller is cancelled as
        that call ends, returns the result and drops the cancellation, so a loop around the
        call never stops."""
        async with asyncio.timeout(self.timeout):
            return await make()

    # -- keys ----------------------------------------------------------------------------
    async def put(self, key: str, value: bytes, *, lease: int = 0) -> None:
        await self._call(f"put {key}", lambda: self._kv.put(key, value, lease=lease, timeout=self.timeout))

    async def get(self, key: str) -> KeyValue | None:
        response = await self._call(f"get {key}", lambda: self._kv.get(key, timeout=self.timeout))
        return _key_value(response.kvs[0]) if response.kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the store revision they were read at."""
        response = await self._call(
            f"get {prefix}*", lambda: self._kv.get(prefix, prefix_range_end(prefix), timeout=self.timeout)
        )
        return [_key_value(kv) for kv in response.kvs], response.header.revision

    async def create(self, key: str, value: bytes, *, lease: int = 0, unless: tuple[str, ...] = ()) -> bool:
        """Put ``key`` only if neither it nor any key in ``unless`` exists, in one transaction;
        True if it was put."""
        kv = self._kv
        compare = [kv.txn_compare_create_revision(k, 0) for k in (key, *unless)]
        put = [kv.txn_op_put(key, value, lease=lease)]
        response = await self._call(
            f"create {key}", functools.partial(kv.txn, compare=compare, success=put, failure=[], timeout=self.timeout)
        )
        return bool(response.succeeded)

    async def delete(self, key: str) -> bool:
        response = await self._call(f"delete {key}", lambda: self._kv.delete(key, timeout=self.timeout))
        return response.deleted > 0

    async def delete_prefix(self, prefix: str) -> int:
        response = await self._call(
            f"delete {prefix}*", lambda: self._kv.delete(prefix, prefix_range_end(prefix), timeout=self.timeout)
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
            await self._call(
                f"txn of {len(chunk)} ops",
                functools.partial(kv.txn, compare=[], success=chunk, failure=[], timeout=self.timeout),
            )

    # -- leases --------------------------------------------------------------------------
    async def grant(self, ttl: int) -> int:
        response = await self._call("lease grant", lambda: self._lease.grant(ttl, timeout=self.timeout))
        return response.ID

    async def revoke(self, lease_id: int) -> None:
        try:
            await self._call("lease revoke", lambda: self._lease.revoke(lease_id, timeout=self.timeout))
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

        return await self._call("lease keepalive", once)

    # -- watch ---------------------------------------------------------------------------
    async def watch_prefix(self, prefix: str, start_revision: int = 0) -> AsyncIterator[WatchEvent]:
        """Events under ``prefix`` from ``start_revision`` (reconnects on transient errors)."""
        stream = self._watch.watch(prefix, prefix_range_end(prefix), start_revision=start_revision)
        try:
            async for response in stream:
                if response.canceled:  # e.g. not permitted: etcd cancels the watch instead of failing it
                    raise ClusterError(f"etcd cancelled the watch of {prefix}: {response.cancel_reason}")
                for event in response.events:
                    kind = "delete" if event.type == 1 else "put"
                    yield WatchEvent(kind, event.kv.key.decode(), event.kv.value, event.kv.lease)
        except _TRANSPORT_ERRORS as exc:
            raise ClusterError(f"etcd watch {prefix} failed: {exc!r}") from exc
        finally:
            await stream.aclose()  # type: ignore[attr-defined]  # etcd3aio's watch is an async generator


def _strip_scheme(endpoints: list[str], tls_ca: object) -> list[str]:
    """``http://`` / ``https://`` endpoints -> ``host:port``; ``https://`` needs a CA to trust."""
    plain = []
    for endpoint in endpoints:
        scheme, sep, rest = endpoint.partition("://")
        if sep:
            if scheme == "https" and not tls_ca:
                raise ClusterError(f"etcd endpoint {endpoint}: https needs the CA certificate to trust (--etcd-tls-ca)")
            if scheme not in ("http", "https"):
                raise ClusterError(f"etcd endpoint {endpoint}: unknown scheme {scheme!r}")
            endpoint = rest
        plain.append(endpoint.rstrip("/"))
    return plain


def _dns_target(endpoints: list[str]) -> str | None:
    """``dns:///host:port`` for a single endpoint whose host is a name (not ``localhost``,
    which etcd3aio maps to 127.0.0.1 itself); None when the ``ipv4:`` target works."""
    if len(endpoints) != 1:
        named = [e for e in endpoints if _is_name(e.rpartition(":")[0])]
        if named:  # gRPC's ``ipv4:`` target would fail at the first call, far from the cause
            raise ClusterError(
                f"etcd endpoints {','.join(endpoints)}: with several endpoints each must be an IP address "
                f"(not {', '.join(named)}); give one name that resolves to every member instead, "
                "such as a Kubernetes Service"
            )
        return None
    host = endpoints[0].rpartition(":")[0]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None if host in ("", "localhost") else f"dns:///{endpoints[0]}"
    return None


def _is_name(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host not in ("", "localhost")
    return False


def _split_userinfo(endpoints: list[str]) -> tuple[list[str], UserPassword | None]:
    """``user:password@host:port`` endpoints -> plain endpoints and those credentials."""
    plain, found = [], None
    for endpoint in endpoints:
        userinfo, at, address = endpoint.rpartition("@")
        if at:
            user, _, password = userinfo.partition(":")
            found = UserPassword(user, password)
        plain.append(address)
    return plain, found


def _key_value(kv) -> KeyValue:
    return KeyValue(kv.key.decode(), kv.value, kv.lease, kv.mod_revision)
