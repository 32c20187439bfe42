"""The asyncio face of the engine, for the workers: submit, stream deltas, abort, and the
two disaggregation hooks (prefill for export, decode from imported KV).

The ``LLMEngine`` runs on one thread of its own; every call is a command executed on that
thread between steps, and outputs come back to the event loop. Model steps never block
the loop. A request the engine fails ends with ``FinishReason.ERROR``; when the engine
itself cannot go on, its thread ends: ``is_alive``, ``wait_dead`` and ``heartbeat_age`` say
so, and ``load_now`` reads the load without waiting for the thread. With ``lending``
(``core_lending``) each step runs on the threads the board allows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import torch

from kvmesh.engine.core_lending import CoreLending, LendingCounts
from kvmesh.engine.kv_cache_manager import PoolStats
from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.outputs import RequestOutput, StepObserver
from kvmesh.engine.own_thread import run_in_own_thread
from kvmesh.engine.request import SamplingParams
from kvmesh.errors import EngineDeadError

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["AsyncEngine", "EngineDeadError", "StepObserver"]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, lending: CoreLending | None = None) -> None:
        self.engine = engine
        self._lending = lending
        self._threads = 0  # the engine thread's OpenMP threads, while lending changes them
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future | None]] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._ended = False  # the thread has finished; guarded by _lock with _dead_waiters
        self._dead_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._lock = threading.Lock()
        self._beat = time.monotonic()
        self._load = engine.load()  # replaced (never mutated) by the engine thread
        self._observer: StepObserver | None = None
        model = getattr(engine, "model", None)
        if model is not None and hasattr(model, "between_layers"):  # kvmesh's model: a borrowed step gives back between layers
            model.between_layers = self._give_back if lending is not None else None
        self._thread = threading.Thread(target=self._run, name="kvmesh-engine", daemon=True)
        self._thread.start()

    @classmethod
    async def create(cls, config: EngineConfig | None = None) -> AsyncEngine:
        """Load the model off the event loop (on a thread that ends with the loading:
        ``own_thread`` says why), then start the engine thread."""
        engine = await run_in_own_thread(lambda: LLMEngine(config), "kvmesh-engine-load")
        return cls(engine)

    # -- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._beat = time.monotonic()
                idle = not self.engine.has_unfinished()
                if idle:
                    self._lend()
                self._run_commands(wait=idle)
                self._load = self.engine.load()
                if self.engine.has_unfinished():
                    self._borrow()
                    started = time.perf_counter()
                    outputs = self.engine.step()
                    self._load = self.engine.load()
                    if self.engine.last_step_tokens and self._observer is not None:
                        self._stepped(outputs, time.perf_counter() - started)
                    self._deliver(outputs)
                    if not self.engine.last_step_tokens:
                        # Nothing could be scheduled (no room); wait for a command to change that.
                        self._lend()
                        self._run_commands(wait=True)
                        self._load = self.engine.load()
        except BaseException as exc:  # noqa: BLE001 - the thread must report any failure
            logger.exception("engine thread failed")
            self._error = exc
        finally:
            self._stop.set()
            model = getattr(self.engine, "model", None)
            if getattr(model, "between_layers", None) == self._give_back:  # not to read a closed board later
                model.between_layers = None  # type: ignore[union-attr]
            if self._lending is not None:
                self._lending.close()
            self._fail_everything()
            self._wake_dead_waiters()

    def _borrow(self) -> None:
        """Before a step: the threads the lending board allows now."""
        if self._lending is None:
            return
        self._set_threads(self._lending.threads_for_step())

    def _give_back(self) -> None:
        """Between a step's layers: back to this engine's share once another engine wants
        the cores it borrowed."""
        if self._lending is not None and self._threads > self._lending.own:
            threads = self._lending.give_back()
            if threads is not None:
                self._set_threads(threads)

    def _set_threads(self, threads: int) -> None:
        if threads != self._threads:
            torch._C.set_num_threads(threads)  # torch's own: vLLM's CPU worker makes torch.set_num_threads a no-op
            self._threads = threads

    def _lend(self) -> None:
        """While waiting for work: the cores are the others' to use."""
        if self._lending is not None:
            self._lending.idle()

    def observe_steps(self, observer: StepObserver) -> None:
        """Tell ``observer`` of every request and step from now on."""
        self._observer = observer

    def _observe(self, call: Callable[[StepObserver], None]) -> None:
        observer = self._observer
        if observer is None:
            return
        try:
            call(observer)
        except Exception:  # noqa: BLE001 - metrics never stop the engine
            logger.exception("the step observer failed")

    def _stepped(self, outputs: list[RequestOutput], seconds: float) -> None:
        preemptions = int(getattr(self.engine, "num_preemptions", 0))  # VllmCore's: from vLLM's stats
        self._observe(lambda o: o.stepped(outputs, seconds, preemptions))

    def _run_commands(self, wait: bool) -> None:
        try:
            command, future = self._commands.get(timeout=0.1) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            # A caller that stopped waiting (cancelled) still gets its command run, but its
            # future takes no result: setting one on a cancelled future would raise here.
            wanted = future is not None and future.set_running_or_notify_cancel()
            try:
                result = command()
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                if wanted and future is not None:
                    future.set_exception(exc)
            else:
                if wanted and future is not None:
                    future.set_result(result)
            try:
                command, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            loop, q = stream
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:  # that event loop is closed: nobody is listening
                self._streams.pop(out.request_id, None)

    def _fail_everything(self) -> None:
        error = EngineDeadError(f"engine stopped: {self._error!r}" if self._error else "engine stopped")
        for loop, q in list(self._streams.values()):
            try:
                loop.call_soon_threadsafe(q.put_nowait, error)
            except RuntimeError:  # that event loop is closed
                pass
        self._fail_commands(error)

    def _fail_commands(self, error: EngineDeadError) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(error)

    def _wake_dead_waiters(self) -> None:
        with self._lock:
            self._ended = True
            waiters, self._dead_waiters = self._dead_waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, future, self._error)
            except RuntimeError:  # that event loop is closed
                pass

    async def _call(self, command: Callable[[], T]) -> T:
        if self._stop.is_set():
            raise EngineDeadError("engine stopped")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((command, future))
        if self._stop.is_set():  # the thread may have emptied the queue just before the put
            self._fail_commands(EngineDeadError("engine stopped"))
        return await asyncio.wrap_future(future)

    # -- requests ------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        export_kv: bool = False,
        first: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request (``first``: ahead of those waiting) and iterate its outputs;
        leaving early aborts it."""
        q = self._open_stream(request_id)
        self._observe(lambda o: o.arrived(request_id))
        try:
            await self._call(
                lambda: self.engine.add_request(request_id, prompt_token_ids, params, export_kv=export_kv, first=first)
            )
        except BaseException as exc:
            self._forget_stream(request_id, exc)
            raise
        async for out in self._drain(request_id, q):
            yield out

    async def generate_from_import(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        handle: str,
        params: SamplingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Decode a request whose prompt KV was written into the blocks of ``handle``; the
        first output carries ``first_token_id``."""
        q = self._open_stream(request_id)
        self._observe(lambda o: o.arrived(request_id))

        def command() -> None:
            first = self.engine.add_imported_request(request_id, prompt_token_ids, first_token_id, handle, params)
            self._observe(lambda o: o.imported(first))
            self._deliver([first])  # from the engine thread, so it is queued before any later step's output

        try:
            await self._call(command)
        except BaseException as exc:
            self._forget_stream(request_id, exc)
            raise
        async for out in self._drain(request_id, q):
            yield out

    def _open_stream(self, request_id: str) -> asyncio.Queue:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def _forget_stream(self, request_id: str, exc: BaseException) -> None:
        """The submission failed or its caller was cancelled; a cancelled submission still
        runs on the engine thread, so an abort follows it there."""
        self._streams.pop(request_id, None)
        self._observe(lambda o: o.closed(request_id))
        if not isinstance(exc, Exception) and not self._stop.is_set():
            self._commands.put((lambda: self.engine.abort_request(request_id), None))

    async def _drain(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._observe(lambda o: o.closed(request_id))
            if not finished and not self._stop.is_set():
                self._commands.put((lambda: self.engine.abort_request(request_id), None))

    async def prefill_export(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None, *, first: bool = False
    ) -> RequestOutput:
        """Prefill and sample the first token; the blocks stay held (``out.kv_export``)
        until ``release_export``."""
        last: RequestOutput | None = None
        async for out in self.generate(request_id, prompt_token_ids, params, export_kv=True, first=first):
            last = out
        assert last is not None and last.finished
        return last

    async def abort(self, request_id: str) -> bool:
        """Stop a request; its stream (if someone iterates it) ends with an ``abort`` output."""

        def command() -> bool:
            out = self.engine.abort_request(request_id)
            if out is not None:
                self._deliver([out])
            return out is not None

        return await self._call(command)

    async def release_export(self, request_id: str) -> bool:
        return await self._call(lambda: self.engine.release_export(request_id))

    async def allocate_import(
        self, handle: str, num_tokens: int, params: SamplingParams | None = None, resumed: bool = False
    ) -> list[int] | None:
        return await self._call(lambda: self.engine.allocate_import(handle, num_tokens, params, resumed))

    async def release_import(self, handle: str) -> bool:
        return await self._call(lambda: self.engine.release_import(handle))

    async def cached_prefix_length(self, block_hashes: list[int]) -> int:
        return await self._call(lambda: self.engine.cached_prefix_length(block_hashes))

    async def lend_cached_blocks(self, handle: str, block_hashes: list[int]) -> list[int]:
        return await self._call(lambda: self.engine.lend_cached_blocks(handle, block_hashes))

    async def cache_imported_blocks(self, handle: str, block_hashes: list[int], parent_hash: int | None) -> None:
        await self._call(lambda: self.engine.cache_imported_blocks(handle, block_hashes, parent_hash))

    async def pool_stats(self) -> PoolStats:
        return await self._call(self.engine.pool_stats)

    async def take_kv_events(self) -> list:
        if not self.engine.has_kv_events():  # idle: no round trip to the engine's thread (10 a second a worker)
            return []
        return await self._call(self.engine.take_kv_events)

    async def kv_snapshot(self) -> tuple[list, list[int]]:
        return await self._call(self.engine.kv_snapshot)

    async def load(self) -> dict[str, int]:
        """``load_now()``, or ``EngineDeadError`` once the engine has stopped."""
        if self._stop.is_set():
            raise EngineDeadError("engine stopped")
        return self.load_now()

    def load_now(self) -> dict[str, int]:
        """Running and waiting requests and free blocks as of the engine thread's last step
        or command round (as ``LLMEngine.load``), read without waiting for that thread."""
        return dict(self._load)

    def lending_counts(self) -> LendingCounts | None:
        """What lending cores did (``--lend-cores``) as of now, read without waiting for the
        engine thread; None without lending."""
        if self._lending is None:
            return None
        counts = self._lending.counts
        return LendingCounts(counts.borrowed, counts.given_back, counts.wait_given_up)

    # -- health --------------------------------------------------------------------------
    def is_alive(self) -> bool:
        """The engine thread is running and has not been told to stop."""
        return self._thread.is_alive() and not self._stop.is_set()

    def heartbeat_age(self) -> float:
        """Seconds since the engine thread last went round its loop: at most about 0.1 s
        when idle, the length of the step in progress when busy; it grows without bound
        once the thread has ended."""
        return time.monotonic() - self._beat

    async def wait_dead(self) -> BaseException | None:
        """Return once the engine thread has ended: the error that ended it, or ``None``
        after ``shutdown``. Any number of callers, on any event loop, before or after."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        with self._lock:
            if self._ended:
                return self._error
            self._dead_waiters.append((loop, future))
        try:
            return await future
        finally:
            with self._lock:
                if (loop, future) in self._dead_waiters:
                    self._dead_waiters.remove((loop, future))

    # -- lifetime ------------------------------------------------------------------------
    async def shutdown(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 10.0)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        future.set_result(error)
