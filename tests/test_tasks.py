"""``kvmesh.tasks.cancel_and_wait``: the task ends, its failure is logged, and the caller's own
cancellation is not swallowed."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvmesh.tasks import cancel_and_wait


async def test_the_task_has_ended_when_it_returns() -> None:
    task = asyncio.create_task(asyncio.sleep(60))
    await cancel_and_wait(task)
    assert task.cancelled()
    await cancel_and_wait(None)
    await cancel_and_wait(task)  # a finished task is fine too


async def test_a_failure_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails(), name="failing")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="kvmesh.tasks"):
        await cancel_and_wait(task)
    assert "failing" in caplog.text and "boom" in caplog.text


async def test_the_callers_own_cancellation_propagates() -> None:
    async def stubborn() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # takes a while to stop
            raise

    inner = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    outer = asyncio.create_task(cancel_and_wait(inner))
    await asyncio.sleep(0.05)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    await asyncio.wait([inner])
