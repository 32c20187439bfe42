"""A request's heartbeat: its end neither waits forever on a beat that lost its stop nor swallows
the request's own cancellation."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.worker.heartbeat import Heartbeat
from tests.cancellation import sleep_swallowing_cancellation


class _SwallowingNats:
    """A NATS client whose publish swallows a cancellation, as nats-py's forced flush of a full
    pending buffer does (``except asyncio.CancelledError: pass``)."""

    def __init__(self) -> None:
        self.publishing = asyncio.Event()
        self.published = 0

    async def publish(self, subject: str, payload: bytes) -> None:
        self.publishing.set()
        await sleep_swallowing_cancellation(0.3)
        self.published += 1


def _heartbeat(nc: _SwallowingNats) -> Heartbeat:
    return Heartbeat(nc, "progress.r1", "r1", "w1", interval=0.05, stage="prefill", engine_stepping=lambda: True)  # type: ignore[arg-type]


async def test_the_end_of_a_heartbeat_whose_publish_swallowed_the_stop_does_not_hang() -> None:
    nc = _SwallowingNats()
    async with asyncio.timeout(5):
        async with _heartbeat(nc):
            await nc.publishing.wait()  # the block ends while a beat is being published
    assert nc.published >= 1


class _SlowToStopNats(_SwallowingNats):
    """A publish that takes a while to give up when cancelled, and then does."""

    async def publish(self, subject: str, payload: bytes) -> None:
        self.publishing.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.5)
            raise


async def test_the_requests_own_cancellation_propagates_through_the_heartbeats_end() -> None:
    """The request is cancelled (its client went away) while its heartbeat is stopping: the
    request ends there, it does not go on as if nothing happened (the exit's wait for the beat
    sat under ``except CancelledError: pass``, which could catch the request's own)."""
    nc = _SlowToStopNats()
    went_on = []
    stopping = asyncio.Event()

    async def request() -> None:
        beat = _heartbeat(nc)
        async with beat:
            await nc.publishing.wait()
            stopping.set()  # the block ends; its exit waits for the beat to stop
        went_on.append(True)

    task = asyncio.create_task(request())
    await stopping.wait()
    await asyncio.sleep(0.1)
    task.cancel()
    async with asyncio.timeout(5):
        with pytest.raises(asyncio.CancelledError):
            await task
    assert went_on == []
