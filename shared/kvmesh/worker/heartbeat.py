"""A worker's "still working on it" for one request: a ``Progress`` message to the router
every heartbeat interval while the request is here and the engine is stepping.

The router gives up on a worker that has been silent about a request for its silence
timeout, so a long prefill is told from a dead, hung or cut-off worker without a timeout
that would have to guess how long prompts take.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import TracebackType

import nats

from kvmesh.protocol import Progress, Stage
from kvmesh.tasks import cancel_and_wait, pause

logger = logging.getLogger(__name__)


class Heartbeat:
    """``async with Heartbeat(...) as beat:`` beats until the block ends; set ``beat.stage``
    as the request moves on."""

    def __init__(
        self,
        nc: nats.NATS,
        subject: str | None,
        request_id: str,
        worker_id: str,
        *,
        interval: float,
        stage: Stage,
        engine_stepping: Callable[[], bool],
    ) -> None:
        self.nc = nc
        self.subject = subject
        self.request_id = request_id
        self.worker_id = worker_id
        self.interval = interval
        self.stage: Stage = stage
        self.engine_stepping = engine_stepping
        self.sent = 0
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Heartbeat:
        if self.subject is not None:
            self._task = asyncio.create_task(self._beat(), name=f"heartbeat {self.request_id}")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # bounded, and the request's own cancellation (a client gone) still propagates: a bare
        # ``await`` under ``except CancelledError`` swallowed it, and waited forever on a beat
        # whose publish had swallowed the stop (nats-py's flush of a full buffer does)
        await cancel_and_wait(self._task)

    async def _beat(self) -> None:
        assert self.subject is not None
        while True:
            await pause(self.interval)
            if not self.engine_stepping():
                continue  # a stalled engine goes quiet, and the router gives up on it
            message = Progress(request_id=self.request_id, worker_id=self.worker_id, stage=self.stage)
            try:
                await self.nc.publish(self.subject, message.encode())
                self.sent += 1
            except Exception as exc:  # noqa: BLE001 - a lost beat is what the router's timeout is for
                logger.debug("heartbeat of %s not sent: %s", self.request_id, exc)
