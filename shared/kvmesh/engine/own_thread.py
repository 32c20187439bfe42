"""Heavy set-up work (loading a model, packing its weights, warming it up) run on a thread of
its own that ends when the work does, never on a pool thread that lives on.

Why: torch's CPU operators run their parallel regions on OpenMP (libgomp), which keeps one
pool of helper threads for each thread that has run a parallel region, alive as long as that
thread is. While more such helpers exist than the process has cores, libgomp stops letting
them spin between regions: every region's helpers go to sleep and must be woken for the
next, and each wake-up of an idle core costs ~0.1-0.2 ms, about what a small decode-step
operator takes. An engine built on ``asyncio.to_thread``'s pool thread (which lives on with
its OpenMP pool) and stepped on the engine thread (a second pool) ran every operator of
every step at about half speed: a batch-1 decode step 25 ms instead of 14 on two cores
(``benchmarks/engine_thread_bench.py``). A thread that has ended takes its pool with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["call_in_own_thread", "run_in_own_thread"]


def call_in_own_thread(work: Callable[[], T], name: str) -> T:
    """``work()`` on a new thread called ``name``, the caller blocked until that thread has
    ended (and with it any OpenMP pool it made); its result, or its exception raised here."""
    outcome: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            outcome.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller
            outcome.set_exception(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    return outcome.result()


async def run_in_own_thread(work: Callable[[], T], name: str) -> T:
    """``call_in_own_thread`` awaited without blocking the event loop: asyncio's pool thread
    only waits for the new one (it runs no torch work, so it makes no OpenMP pool).
    Cancelling the wait does not stop the work: the thread runs to its end and its result
    is dropped."""
    return await asyncio.to_thread(call_in_own_thread, work, name)
