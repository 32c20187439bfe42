"""Where the rate limiter's window counters live: this process, or a NATS JetStream KV bucket.

A counter is named by ``(kind, key name, window seconds)`` and holds the tokens used in the
window ``index`` (``int(time // window)``). ``LocalCounters`` keeps the current window of each
in memory. ``NatsCounters`` keeps them in the bucket ``kvmesh_<namespace>_ratelimits`` (one KV
key per counter and window, ``<kind>.<name>.<window>s.<index>``, history 1, entries expire after
two days), so every router of the namespace counts against the same budget; updates use
optimistic concurrency (``update(..., last=revision)``, retried on a wrong last sequence), each
call within a timeout. When NATS does not answer, it counts locally and warns, and tries NATS
again a few seconds later: a limiter's store being down never fails a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from kvmesh.protocol import rate_limit_bucket

__all__ = ["CounterStore", "LocalCounters", "NatsCounters", "bucket_name"]

logger = logging.getLogger(__name__)

Counter = tuple[str, str, int]  # kind, key name, window seconds
BUCKET_TTL = 2 * 86400.0  # seconds: twice the longest window
CAS_TRIES = 32


class CounterStore(Protocol):
    async def read(self, counter: Counter, index: int) -> int: ...

    async def add_within(self, counter: Counter, index: int, amount: int, limit: int) -> bool:
        """Add ``amount`` if the window's total stays within ``limit``; whether it was added."""
        ...

    async def add(self, counter: Counter, index: int, amount: int) -> None: ...


class LocalCounters:
    """The current window of each counter, in this process."""

    def __init__(self) -> None:
        self._windows: dict[Counter, tuple[int, int]] = {}  # counter -> (index, used)

    def used(self, counter: Counter, index: int) -> int:
        window, used = self._windows.get(counter, (index, 0))
        return used if window == index else 0

    def _set(self, counter: Counter, index: int, used: int) -> None:
        if self._windows.get(counter, (index, 0))[0] <= index:  # a late charge never rewinds a window
            self._windows[counter] = (index, used)

    async def read(self, counter: Counter, index: int) -> int:
        return self.used(counter, index)

    async def add_within(self, counter: Counter, index: int, amount: int, limit: int) -> bool:
        used = self.used(counter, index)
        if used + amount > limit:
            return False
        self._set(counter, index, used + amount)
        return True

    async def add(self, counter: Counter, index: int, amount: int) -> None:
        self._set(counter, index, self.used(counter, index) + amount)


bucket_name = rate_limit_bucket  # the name is part of the protocol: routers' NATS permissions name it


class _Contended(Exception):
    """The compare-and-set lost too many races in a row."""


class NatsCounters:
    """Counters in a JetStream KV bucket, shared by every router; ``LocalCounters`` when NATS is away."""

    def __init__(
        self, nc: Any, namespace: str, *, timeout: float = 0.5, retry_after: float = 5.0, clock: Any = time.monotonic
    ) -> None:
        self.nc = nc
        self.bucket = bucket_name(namespace)
        self.timeout = timeout
        self.retry_after = retry_after  # seconds the local fallback is used before NATS is tried again
        self.clock = clock
        self.fallback = LocalCounters()
        self._kv: Any = None
        self._down_until = 0.0
        self._down = False

    async def _bucket(self) -> Any:
        if self._kv is None:
            from nats.js.errors import BucketNotFoundError

            js = self.nc.jetstream(timeout=self.timeout)
            try:
                self._kv = await js.key_value(self.bucket)
            except BucketNotFoundError:
                self._kv = await js.create_key_value(bucket=self.bucket, history=1, ttl=BUCKET_TTL)
        return self._kv

    async def _shared(self, work: Any) -> Any:
        """``work(kv)`` against the bucket; raises ``LookupError`` when the local fallback must serve."""
        if self.clock() < self._down_until:
            raise LookupError("NATS did not answer a moment ago")
        try:
            if not getattr(self.nc, "is_connected", False):
                raise ConnectionError("not connected to NATS")
            result = await asyncio.wait_for(self._run(work), self.timeout)
        except Exception as exc:
            self._down_until = self.clock() + self.retry_after
            if not self._down:
                logger.warning(
                    "rate limits: the NATS KV bucket %s did not answer (%s); counting in this router alone until it does",
                    self.bucket,
                    str(exc) or type(exc).__name__,
                )
            self._down = True
            raise LookupError(str(exc)) from exc
        if self._down:
            logger.warning("rate limits: the NATS KV bucket %s answers again; budgets are shared again", self.bucket)
            self._down = False
        return result

    async def connect(self) -> bool:
        """Open (or create) the bucket now, so a store out of reach is reported at start."""
        try:
            await self._shared(lambda kv: kv.status())
        except LookupError:
            return False
        return True

    async def _run(self, work: Any) -> Any:
        return await work(await self._bucket())

    @staticmethod
    def _key(counter: Counter, index: int) -> str:
        kind, name, window = counter
        return f"{kind}.{name}.{window}s.{index}"

    @staticmethod
    async def _get(kv: Any, key: str) -> tuple[int, int | None]:
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            return 0, None
        return int(entry.value or b"0"), entry.revision

    async def read(self, counter: Counter, index: int) -> int:
        key = self._key(counter, index)
        try:
            used, _ = await self._shared(lambda kv: self._get(kv, key))
        except LookupError:
            return await self.fallback.read(counter, index)
        return int(used)

    async def add_within(self, counter: Counter, index: int, amount: int, limit: int) -> bool:
        key = self._key(counter, index)

        async def cas(kv: Any) -> bool:
            from nats.js.errors import KeyWrongLastSequenceError

            for _ in range(CAS_TRIES):
                used, revision = await self._get(kv, key)
                if used + amount > limit:
                    return False
                value = str(used + amount).encode()
                try:
                    if revision is None:
                        await kv.create(key, value)
                    else:
                        await kv.update(key, value, last=revision)
                    return True
                except KeyWrongLastSequenceError:
                    continue  # another router got there first: read again
            raise _Contended(f"{key}: {CAS_TRIES} lost updates in a row")

        try:
            return bool(await self._shared(cas))
        except LookupError:
            return await self.fallback.add_within(counter, index, amount, limit)

    async def add(self, counter: Counter, index: int, amount: int) -> None:
        await self.add_within(counter, index, amount, 1 << 62)
