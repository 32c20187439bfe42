"""Background asyncio tasks: stopping one without losing the caller's own cancellation."""

from __future__ import annotations

import asyncio
import logging

__all__ = ["cancel_and_wait"]

logger = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` and wait until it has ended. A failure it ended with is logged, not
    raised; a cancellation of the caller itself still propagates (``await task`` inside
    ``except CancelledError: pass`` would swallow it)."""
    if task is None:
        return
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled() and task.exception() is not None:
        logger.warning("background task %s failed: %r", task.get_name(), task.exception())
