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
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["call_in_own_thread", "run_in_own_thread"]


class _Outcome(Generic[T]):
    """What ``work()`` returned or raised on the thread that ran it, for the caller."""

    def __init__(self, work: Callable[[], T]) -> None:
        self.work = work
        self.value: list[T] = []
        self.failure: list[BaseException] = []

    def run(self) -> None:
        try:
            self.value.append(self.work())
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller
            self.failure.append(exc)

    def result(self) -> T:
        if self.failure:
            raise self.failure[0]
        return self.value[0]


def call_in_own_thread(work: Callable[[], T], name: str) -> T:
    """``work()`` on a new thread called ``name``, the caller blocked until that thread has
    ended; its result, or its exception raised here (for scripts without an event loop)."""
    outcome = _Outcome(work)
    thread = threading.Thread(target=outcome.run, name=name)
    thread.start()
    thread.join()
    return outcome.result()


async def run_in_own_thread(work: Callable[[], T], name: str) -> T:
    """``work()`` on a new thread called ``name``, awaited without blocking the event loop;
    returns (or raises) once that thread has ended, and with it any OpenMP pool it made.
    Cancelling the wait does not stop the work: the thread runs to its end and its result
    is dropped."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    outcome = _Outcome(work)

    def run() -> None:
        outcome.run()
        try:
            loop.call_soon_threadsafe(_finish, done)
        except RuntimeError:  # the event loop closed meanwhile: nobody is waiting
            pass

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    await done
    # ``run`` has returned; the thread's own clean-up (its OpenMP pool) follows at once
    await asyncio.to_thread(thread.join)
    return outcome.result()


def _finish(done: asyncio.Future) -> None:
    if not done.done():
        done.set_result(None)
