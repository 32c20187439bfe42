"""Consuming a backend's token events over HTTP: disconnect handling, error mapping and SSE.

A non-streamed answer (and a stream's first event) is awaited with ``unless_disconnected``; a
streamed one is an ``EventStreamResponse`` over an ``EventStream``, which closes the backend
iterator (cancelling an unfinished request) and records the outcome once, however the response
ends. Both wait in the request's own task, which a watcher of the client's ``receive`` cancels
when the client leaves (``_CancelOnLeave``). Both end early when the router shuts down: a 503,
or an error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from kvmesh.errors import ERROR_KINDS, ErrorCode, MeshError
from kvmesh.protocol import TokenEvent
from kvmesh.services.router.choices import ChoiceLogprobs, PromptEcho
from kvmesh.services.router.metrics import RequestTracker
from kvmesh.services.router.openai_api import SSE_DONE, APIError, ChatFormat, CompletionFormat, Usage, sse_event
from kvmesh.services.router.shutdown import Shutdown

__all__ = [
    "CLIENT_CLOSED",
    "ClientGone",
    "EventStream",
    "EventStreamResponse",
    "StreamedChoice",
    "aclose",
    "as_api_error",
    "check_event",
    "unless_disconnected",
]

logger = logging.getLogger(__name__)

CLIENT_CLOSED = ERROR_KINDS[ErrorCode.CANCELLED].http_status  # 499, nginx's "client closed request"

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


def check_event(event: TokenEvent | None) -> TokenEvent:
    if event is None:
        raise MeshError("internal", "the token stream ended before the request finished")
    if event.error is not None:
        raise MeshError(event.error.code, event.error.message)
    return event


def as_api_error(exc: BaseException, request_id: str) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, MeshError):
        return APIError(exc.http_status, exc.message, code=exc.code.value)
    if isinstance(exc, ClientGone):
        return APIError(CLIENT_CLOSED, "the client closed the request", code="cancelled")
    logger.error("request %s failed", request_id, exc_info=exc)
    return APIError(500, "internal error in the router", code="internal")


async def aclose(events: AsyncIterator[Any]) -> None:
    """Close a backend iterator (which cancels its request if unfinished), shielded from cancellation."""
    close = getattr(events, "aclose", None)
    if close is None:
        return
    with anyio.CancelScope(shield=True):
        await close()


async def _anext_or_none(events: AsyncIterator[TokenEvent]) -> TokenEvent | None:
    return await anext(events, None)


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _CancelOnLeave:
    """From its making until ``stop`` the current task is cancelled when the client disconnects
    (or, given a ``Shutdown``, when the router begins shutting down); ``cause`` then says which.

    The work stays in the caller's task: waiting for it in a task of its own, beside a watcher,
    cost a stream's first token two more tasks and turns of the event loop. The watcher is one
    task reading ``receive`` until the client leaves."""

    def __init__(self, receive: Receive, shutdown: Shutdown | None = None) -> None:
        self.cause: str | None = None  # "gone" or "shutdown", once it cancelled the task
        self._task = asyncio.current_task()
        self._watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        self._watcher.add_done_callback(self._client_left)
        self._stopping = shutdown.future() if shutdown is not None else None
        if self._stopping is not None:
            self._stopping.add_done_callback(self._shutting_down)

    def _client_left(self, watcher: asyncio.Future[None]) -> None:
        if watcher.cancelled():
            return
        if watcher.exception() is not None:  # ``receive`` itself failed: taken as the client gone
            logger.debug("reading the client's disconnect failed: %r", watcher.exception())
        self._cancel("gone")

    def _shutting_down(self, _: asyncio.Future[None]) -> None:
        self._cancel("shutdown")

    def _cancel(self, cause: str) -> None:
        if self.cause is None and self._task is not None:
            self.cause = cause
            self._task.cancel()

    def stop(self) -> bool:
        """Stop watching. True when this cancelled the task and nothing else did: the
        ``CancelledError`` the task met (or its work swallowed) is this one's, taken back."""
        self._watcher.remove_done_callback(self._client_left)
        self._watcher.cancel()
        if self._stopping is not None:
            self._stopping.remove_done_callback(self._shutting_down)
        if self.cause is None or self._task is None:
            return False
        return self._task.uncancel() == 0


async def unless_disconnected(request: Request, work: Awaitable[T], shutdown: Shutdown) -> T:
    """Await ``work`` in this task; cancel it and raise ``ClientGone`` if the client goes away
    first, or the shutdown's 503 ``APIError`` if the router begins shutting down first."""
    leave = _CancelOnLeave(request.receive, shutdown)
    try:
        result = await work
    except asyncio.CancelledError:
        if not leave.stop():
            raise
        if leave.cause == "shutdown":
            raise shutdown.error() from None
        raise ClientGone() from None
    except BaseException:
        leave.stop()
        raise
    leave.stop()
    return result


@dataclass(slots=True)
class StreamedChoice:
    """One choice of a streamed answer: its backend events, the first already received."""

    events: AsyncIterator[TokenEvent]
    first: TokenEvent
    tracker: RequestTracker
    logprobs: ChoiceLogprobs | None = None  # with logprobs: each chunk's, in the endpoint's shape
    echo: PromptEcho | None = None  # completions' echo: the prompt's text (and logprobs) first
    counts_prompt: bool = True  # False for a prompt's choices after its first (``n``): usage counts it once

    def usage(self) -> Usage:
        usage = self.tracker.usage()
        return usage if self.counts_prompt else usage.completion_only()


class EventStream:
    """One streamed answer: its SSE chunks (each choice's events as they come, tagged with its
    index), and a cleanup that runs once however the stream ends."""

    def __init__(
        self,
        choices: list[StreamedChoice],
        fmt: CompletionFormat | ChatFormat,
        shutdown: Shutdown,
    ) -> None:
        self._choices = choices
        self._fmt = fmt
        self._shutdown = shutdown
        self.status = CLIENT_CLOSED  # unless the stream runs to its end
        self._closed = False
        self._pending: dict[int, asyncio.Future[TokenEvent | None]] = {}

    async def chunks(self) -> AsyncGenerator[str, None]:
        fmt, choices = self._fmt, self._choices
        try:
            for chunk in fmt.opening_chunks(len(choices)):
                yield sse_event(chunk)
            for index, choice in enumerate(choices):
                echoed = fmt.content_chunk(choice.echo.text, index, choice.echo.fragment(choice.logprobs)) if choice.echo else None
                if echoed is not None:
                    yield sse_event(echoed)
            ready = [(index, choice.first) for index, choice in enumerate(choices)]
            while ready:
                for index, event in ready:
                    choice = choices[index]
                    tracker = choice.tracker
                    tracker.on_event(event)
                    logprobs = choice.logprobs.fragment(event.token_ids, event.logprobs) if choice.logprobs and event.token_ids else None
                    if event.text or logprobs is not None:
                        chunk = fmt.content_chunk(event.text, index, logprobs)
                        if chunk is not None:  # None: held back (a tool call's text, parsed at the end)
                            yield sse_event(chunk)
                    if event.finished:
                        for chunk in fmt.final_chunks(tracker.finish_reason, index):
                            yield sse_event(chunk)
                    else:
                        self._fetch(index)
                ready = [(index, check_event(event)) for index, event in await self._next_events()]
            if fmt.include_usage:
                yield sse_event(fmt.usage_chunk(Usage.total([c.usage() for c in choices])))
            self.status = 200
            yield SSE_DONE
        except Exception as exc:
            error = as_api_error(exc, choices[0].tracker.request_id)
            self.status = error.status
            yield sse_event(error.body())
            yield SSE_DONE
        finally:
            await self.close()

    def _fetch(self, index: int) -> None:
        """Ask a choice's backend for its next event, in a task of its own: the choices of a
        request stream side by side, and a stream ended from outside (the client left, the
        server cancelled it; under Starlette's own streaming, an anyio scope that re-cancels
        every later await in it) leaves the backend iterator to ``close``, which cancels these
        tasks once and closes it, its cleanup (telling the mesh to cancel) free to await.
        """
        self._pending[index] = asyncio.ensure_future(_anext_or_none(self._choices[index].events))

    async def _next_events(self) -> list[tuple[int, TokenEvent | None]]:
        """The events that arrived, by choice index; none once every choice has finished. The
        router shutting down ends the wait with its 503 ``APIError``."""
        if not self._pending:
            return []
        stopping = self._shutdown.future()
        await asyncio.wait({*self._pending.values(), stopping}, return_when=asyncio.FIRST_COMPLETED)
        done = sorted(index for index, task in self._pending.items() if task.done())
        if not done:
            raise self._shutdown.error()
        return [(index, self._pending.pop(index).result()) for index in done]

    async def close(self) -> None:
        """Close the backend iterators (cancelling unfinished requests) and record the outcome."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            waiting = [task for task in self._pending.values() if not task.done()]
            for task in waiting:
                task.cancel()
            if waiting:
                await asyncio.wait(waiting)
        for choice in self._choices:
            await aclose(choice.events)
            choice.tracker.finish(self.status)
        tracker = self._choices[0].tracker
        tracker.metrics.count(tracker.endpoint, self.status)


class EventStreamResponse(StreamingResponse):
    """SSE whose stream is closed however the response ends: completed, failed or client gone."""

    media_type = "text/event-stream"

    def __init__(self, stream: EventStream) -> None:
        self._chunks = stream.chunks()
        self._stream = stream
        super().__init__(self._chunks, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Starlette's streaming, with the chunks sent from this task: Starlette sends them from
        a task of its own, started in an anyio task group, while this one reads ``receive``;
        that put a task's start and a turn of the event loop before the first chunk. Here the
        watcher for the client's leaving starts once the first chunk is out."""
        leave: _CancelOnLeave | None = None
        # a server on ASGI spec 2.4 says the client left by raising from ``send``, as Starlette expects
        watch = tuple(map(int, scope.get("asgi", {}).get("spec_version", "2.0").split("."))) < (2, 4)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                body = chunk if isinstance(chunk, (bytes, memoryview)) else chunk.encode(self.charset)
                await send({"type": "http.response.body", "body": body, "more_body": True})
                if leave is None and watch:
                    leave = _CancelOnLeave(receive)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            ours, leave = leave is not None and leave.stop(), None
            if not ours:  # ours: the client left, and the stream just ends, as Starlette's does
                raise
        except OSError:  # a server that reports a lost client from ``send`` (ASGI spec 2.4)
            raise ClientDisconnect() from None
        finally:
            if leave is not None:
                leave.stop()
            with anyio.CancelScope(shield=True):
                await self._chunks.aclose()
                await self._stream.close()
