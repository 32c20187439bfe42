"""``kvmesh.tasks``: ``cancel_and_wait`` ends the task, logs its failure and keeps the caller's own
cancellation; a task that lost its own cancellation is cancelled again, and one that never stops
is given up on; a loop's ``pause`` ends a loop whose round swallowed its stop."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvmesh.tasks import cancel_and_wait, cancel_requested, pause
from tests.cancellation import sleep_swallowing_cancellation


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


async def test_a_task_that_lost_its_cancellation_is_cancelled_again() -> None:
    """A task that swallowed the cancellation (as ``asyncio.wait_for`` does on Python 3.11 when its
    call ends at that moment) and went back to waiting is cancelled again, and ends. (Once the
    wait had no end: a worker's stop, and a CI run, hung on such a keep-alive task.)"""

    async def loses_it() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(60)

    task = asyncio.create_task(loses_it())
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await cancel_and_wait(task, recancel_after=0.2)
    assert task.cancelled()


async def test_a_task_that_will_not_stop_is_given_up_on(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()

    async def will_not_stop() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(will_not_stop(), name="deaf")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="kvmesh.tasks"):
        async with asyncio.timeout(5):
            await cancel_and_wait(task, recancel_after=0.1, give_up_after=0.3)
    assert not task.done()
    assert "deaf did not stop within" in caplog.text
    release.set()
    task.cancel()
    await asyncio.wait([task])


async def test_cancel_requested_sees_a_swallowed_cancellation() -> None:
    seen = []

    async def swallows() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            pass
        seen.append(cancel_requested())

    assert not cancel_requested()
    task = asyncio.create_task(swallows())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait([task])
    assert seen == [True]


async def test_a_loops_pause_ends_the_loop_whose_stop_a_call_swallowed() -> None:
    """A loop whose round swallowed its stop ends at its next pause, not a pause later (nor
    never: the keep-alive that hung a CI run slept on after such a round)."""
    rounds = []

    async def loop() -> None:
        while True:
            rounds.append(len(rounds))
            await sleep_swallowing_cancellation(60)  # the round's call, which swallows the stop
            await pause(60)

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    task.cancel()
    async with asyncio.timeout(5):
        await asyncio.wait([task])
    assert task.cancelled() and rounds == [0]


async def test_a_pause_is_a_sleep_for_a_task_not_asked_to_stop() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    await pause(0.05)
    assert loop.time() - started >= 0.05
