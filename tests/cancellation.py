"""A wait that swallows a cancellation, for fakes of the calls that do: ``asyncio.wait_for`` on
Python 3.11 when its call ends at the moment of the cancellation, and nats-py's forced flush of a
full pending buffer (``except asyncio.CancelledError: pass``)."""

from __future__ import annotations

import asyncio


async def sleep_swallowing_cancellation(seconds: float) -> None:
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        pass
