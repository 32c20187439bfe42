"""Per-key rate limiting: admission of a request, and its charges while it runs.

``RateLimiter.admit`` is called once a request's prompt is tokenized: it checks, in order, the
key's concurrent requests, its output-token budget (not yet spent in this window) and its
input-token budget (the prompt fits in what is left, and is charged at once). Over a limit it
raises ``RateLimited`` (a 429 with OpenAI's body, code ``rate_limit_exceeded``, and the seconds
until the budget allows it in ``retry_after``); a rejected request is charged nothing. The
``Admission`` it returns is charged the output tokens as they are produced (in batches when the
counters are shared) and releases its concurrency slot at the end; an admitted request is never
cut short, and its input tokens stay charged however it ends. Limits come from ``rate_limits``, counters from ``rate_store``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.services.router.openai_api import APIError
from kvmesh.services.router.rate_limits import KeyLimits, RateLimitConfig, TokenRate
from kvmesh.services.router.rate_store import CounterStore, LocalCounters

__all__ = ["Admission", "RateLimited", "RateLimiter"]

logger = logging.getLogger(__name__)

SHARED_FLUSH_TOKENS = 16  # output tokens gathered before a charge to a shared store


class RateLimited(APIError):
    """429: a key is over one of its limits (``limit``: input_tokens, output_tokens, concurrent)."""

    def __init__(self, message: str, *, limit: str, retry_after: int | None, kind: str = "tokens") -> None:
        super().__init__(429, message, code="rate_limit_exceeded")
        self.limit = limit
        self.retry_after = retry_after
        self.kind = kind  # OpenAI's error type: "tokens" or "requests"

    def body(self) -> dict:
        body = super().body()
        body["error"]["type"] = self.kind
        return body

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


@dataclass(eq=False)
class Admission:
    """One admitted request's share of its key's budgets."""

    limiter: RateLimiter | None
    key: str
    limits: KeyLimits | None
    pending_output: int = 0
    released: bool = False

    def add_output(self, tokens: int) -> None:
        """``tokens`` more output tokens were produced."""
        if self.limiter is None or self.limits is None or self.limits.output is None or tokens <= 0:
            return
        self.pending_output += tokens
        if self.pending_output >= self.limiter.flush_tokens:
            self._flush()

    def release(self) -> None:
        """The request ended (however): free its slot, charge what output is left. Idempotent."""
        if self.released or self.limiter is None:
            return
        self.released = True
        self._flush()
        self.limiter._release(self)

    def _flush(self) -> None:
        if self.pending_output and self.limiter is not None:
            tokens, self.pending_output = self.pending_output, 0
            self.limiter._charge_output(self, tokens)


class RateLimiter:
    """Admits requests against each key's limits; counters in ``store`` (shared or local)."""

    def __init__(
        self,
        config: RateLimitConfig,
        store: CounterStore | None = None,
        *,
        clock: Callable[[], float] = time.time,
        on_reject: Callable[[str, str], None] = lambda key, limit: None,
        shared: bool = False,
    ) -> None:
        self.config = config
        self.store: CounterStore = store or LocalCounters()
        self.clock = clock  # wall-clock seconds: windows are aligned to the epoch in every router
        self.on_reject = on_reject
        self.flush_tokens = SHARED_FLUSH_TOKENS if shared else 1
        self._active: dict[str, int] = {}
        self._charging: dict[str, set[asyncio.Task]] = {}  # output charges not yet stored, by key

    def active(self, key: str) -> int:
        return self._active.get(key, 0)

    def _window(self, rate: TokenRate) -> tuple[int, int]:
        """The current window's index, and whole seconds until it ends (at least 1)."""
        now = self.clock()
        index = int(now // rate.window)
        return index, max(1, math.ceil((index + 1) * rate.window - now))

    def _reject(self, key: str, limit: str, message: str, retry_after: int | None, kind: str = "tokens") -> RateLimited:
        self.on_reject(key, limit)
        logger.info("rate limit: key=%s over %s (retry after %s s)", key, limit, retry_after)
        return RateLimited(message, limit=limit, retry_after=retry_after, kind=kind)

    async def admit(self, key: str, prompt_tokens: int) -> Admission:
        limits = self.config.for_key(key)
        if limits is None:
            return Admission(None, key, None)
        await self.settle(key)  # this key's earlier output is in the counters before we read them
        if limits.max_concurrent is not None:
            if self.active(key) >= limits.max_concurrent:
                raise self._reject(
                    key,
                    "concurrent",
                    f"Rate limit reached for key '{key}' on concurrent requests: limit {limits.max_concurrent}. "
                    "Please try again when one has finished.",
                    1,
                    kind="requests",
                )
        self._active[key] = self.active(key) + 1  # reserved across the awaits below
        try:
            if limits.output is not None:
                await self._check_output(key, limits.output)
            if limits.input is not None:
                await self._charge_input(key, limits.input, prompt_tokens)
        except BaseException:
            self._active[key] -= 1
            raise
        return Admission(self, key, limits)

    async def _check_output(self, key: str, rate: TokenRate) -> None:
        index, retry_after = self._window(rate)
        used = await self.store.read(("output", key, rate.window), index)
        if used >= rate.tokens:
            raise self._reject(
                key,
                "output_tokens",
                f"Rate limit reached for key '{key}' on output tokens per {rate.unit}: limit {rate.tokens}, "
                f"used {used}. Please try again in {retry_after}s.",
                retry_after,
            )

    async def _charge_input(self, key: str, rate: TokenRate, tokens: int) -> None:
        index, retry_after = self._window(rate)
        if tokens > rate.tokens:
            raise self._reject(
                key,
                "input_tokens",
                f"Request too large for key '{key}' on input tokens per {rate.unit}: limit {rate.tokens}, "
                f"requested {tokens}. Shorten the prompt.",
                None,
            )
        counter = ("input", key, rate.window)
        if not await self.store.add_within(counter, index, tokens, rate.tokens):
            used = await self.store.read(counter, index)
            raise self._reject(
                key,
                "input_tokens",
                f"Rate limit reached for key '{key}' on input tokens per {rate.unit}: limit {rate.tokens}, "
                f"used {used}, requested {tokens}. Please try again in {retry_after}s.",
                retry_after,
            )

    def _charge_output(self, admission: Admission, tokens: int) -> None:
        assert admission.limits is not None and admission.limits.output is not None
        rate = admission.limits.output
        index, _ = self._window(rate)
        task = asyncio.get_running_loop().create_task(self.store.add(("output", admission.key, rate.window), index, tokens))
        charging = self._charging.setdefault(admission.key, set())
        charging.add(task)
        task.add_done_callback(charging.discard)
        task.add_done_callback(_log_failure)

    def _release(self, admission: Admission) -> None:
        self._active[admission.key] = max(0, self.active(admission.key) - 1)

    async def settle(self, key: str | None = None) -> None:
        """Wait for the output charges not yet in the store (of ``key``, or all)."""
        tasks = set().union(*self._charging.values()) if key is None else set(self._charging.get(key, ()))
        if tasks:
            await asyncio.wait(tasks)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("rate limits: an output charge failed: %s", task.exception())
