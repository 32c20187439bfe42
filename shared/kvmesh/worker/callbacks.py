"""NATS callbacks that must not wait on the engine.

nats-py runs one subscription's callbacks one after another, so a callback that awaits an
engine command (a release, a cancel, a lend) holds up every later message on that
subscription behind the engine's current step. ``ControlHandlers.wrap`` makes the callback
start the work as a task and return at once; at most ``limit`` such tasks run at a time,
and past that the callback waits for one to finish (back-pressure, never an unbounded
pile of tasks).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

logger = logging.getLogger(__name__)

DEFAULT_LIMIT = 64  # control messages handled at once per worker


class ControlHandlers:
    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._slots = asyncio.Semaphore(limit)
        self._tasks: set[asyncio.Task] = set()

    @property
    def running(self) -> int:
        return len(self._tasks)

    def wrap(self, handler: Callable[[Msg], Awaitable[None]]) -> Callable[[Msg], Awaitable[None]]:
        async def callback(msg: Msg) -> None:
            await self._slots.acquire()
            task = asyncio.create_task(self._run(handler, msg), name=f"control {msg.subject}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return callback

    async def _run(self, handler: Callable[[Msg], Awaitable[None]], msg: Msg) -> None:
        try:
            await handler(msg)
        except Exception:  # noqa: BLE001 - one bad message never stops the others
            logger.exception("handling a message on %s failed", msg.subject)
        finally:
            self._slots.release()

    async def close(self, timeout: float = 2.0) -> None:
        """Let the handlers in flight finish (up to ``timeout`` seconds), then cancel the rest."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
        for task in pending:
            task.cancel()
