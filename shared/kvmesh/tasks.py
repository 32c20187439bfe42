"""Background asyncio tasks: stopping one without losing the caller's own cancellation, and
without waiting forever on one that lost its own."""

from __future__ import annotations

import asyncio
import logging

__all__ = ["cancel_and_wait", "cancel_requested", "pause"]

logger = logging.getLogger(__name__)

# How long a cancelled task may take to end before it is cancelled again (a cancellation it
# lost), and before the wait gives up on it.
RECANCEL_AFTER = 10.0
GIVE_UP_AFTER = 30.0


def cancel_requested() -> bool:
    """Was the running task asked to stop? On Python 3.11 ``asyncio.wait_for`` swallows the
    cancellation of a task whose awaited call ends at the same moment (it returns the call's
    result instead), so a loop that goes on after such a call checks this before waiting again."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def pause(seconds: float) -> None:
    """A background loop's wait between rounds: ``asyncio.sleep``, but a task that was asked to
    stop during the round (and lost the cancellation in a call that swallowed it: nats-py's
    forced flush, ``asyncio.wait_for`` on 3.11) raises ``CancelledError`` here instead of
    sleeping on, so its loop ends."""
    if cancel_requested():
        raise asyncio.CancelledError
    await asyncio.sleep(seconds)


async def cancel_and_wait(task: asyncio.Task | None, *, recancel_after: float = RECANCEL_AFTER,
                          give_up_after: float = GIVE_UP_AFTER) -> None:  # fmt: skip
    """Cancel ``task`` and wait until it has ended. A failure it ended with is logged, not
    raised; a cancellation of the caller itself still propagates (``await task`` inside
    ``except CancelledError: pass`` would swallow it). A task still running ``recancel_after``
    seconds on (its cleanup is slow, or it lost the cancellation) is cancelled again; one still
    running ``give_up_after`` seconds on is left running, with an error logged, so that no
    caller waits forever."""
    if task is None:
        return
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=recancel_after)
    if not done:
        logger.warning("background task %s still running %.0f s after it was cancelled; cancelling it again",
                       task.get_name(), recancel_after)  # fmt: skip
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=max(give_up_after - recancel_after, 0.0))
    if not done:
        logger.error("background task %s did not stop within %.0f s of being cancelled; no longer waiting for it",
                     task.get_name(), give_up_after)  # fmt: skip
        return
    if not task.cancelled() and task.exception() is not None:
        logger.warning("background task %s failed: %r", task.get_name(), task.exception())
