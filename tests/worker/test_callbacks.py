"""A NATS callback hands its work to a task and returns (a release or cancel never waits
behind the engine's step in the subscription's queue); at most ``limit`` run at once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvmesh.worker.callbacks import ControlHandlers


async def test_callbacks_return_at_once_and_run_at_most_limit_at_a_time():
    gate = asyncio.Event()
    started: list[str] = []

    async def slow(msg) -> None:  # as a release awaiting the engine thread
        started.append(msg.subject)
        await gate.wait()

    handlers = ControlHandlers(limit=2)
    callback = handlers.wrap(slow)
    async with asyncio.timeout(1):
        await callback(SimpleNamespace(subject="a"))
        await callback(SimpleNamespace(subject="b"))  # both returned while their work waits
    third = asyncio.create_task(callback(SimpleNamespace(subject="c")))
    await asyncio.sleep(0.05)
    assert started == ["a", "b"] and handlers.running == 2 and not third.done()  # back-pressure at the limit
    gate.set()
    await asyncio.wait_for(third, 1)
    await handlers.close()
    assert started == ["a", "b", "c"] and handlers.running == 0


async def test_a_failing_handler_is_logged_and_frees_its_slot(caplog):
    async def broken(msg) -> None:
        raise RuntimeError("boom")

    handlers = ControlHandlers(limit=1)
    callback = handlers.wrap(broken)
    async with asyncio.timeout(1):
        for _ in range(3):  # each would wait forever for the slot if a failure kept it
            await callback(SimpleNamespace(subject="x"))
        await handlers.close()
    assert caplog.text.count("handling a message on x failed") == 3
