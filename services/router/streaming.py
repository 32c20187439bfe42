"""Consuming a backend's token events over HTTP: disconnect handling, error mapping and SSE.

A non-streamed answer (and a stream's first event) is awaited with ``unless_disconnected``; a
streamed one is an ``EventStreamResponse`` over an ``EventStream``, which closes the backend
iterator (cancelling an unfinished request) and records the outcome once, however the response
ends. Both end early when the router shuts down: a 503, or an error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvmesh.errors import ERROR_KINDS, ErrorCode, MeshError
from kvmesh.protocol import TokenEvent
from kvmesh.services.router.metrics import RequestTracker
from kvmesh.services.router.openai_api import SSE_DONE, APIError, ChatFormat, CompletionFormat, sse_event
from kvmesh.services.router.shutdown import Shutdown

__all__ = [
    "CLIENT_CLOSED",
    "ClientGone",
    "EventStream",
    "EventStreamResponse",
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


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T], shutdown: Shutdown) -> T:
    """Await ``work``; cancel it and raise ``ClientGone`` if the client goes away first, or the
    shutdown's 503 ``APIError`` if the router begins shutting down first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    stopping = shutdown.future()
    try:
        await asyncio.wait({task, watcher, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        if stopping.done():
            raise shutdown.error()
        raise ClientGone()
    return task.result()


class EventStream:
    """One streamed answer: its SSE chunks, and a cleanup that runs once however the stream ends."""

    def __init__(
        self,
        events: AsyncIterator[TokenEvent],
        first: TokenEvent,
        fmt: CompletionFormat | ChatFormat,
        tracker: RequestTracker,
        shutdown: Shutdown,
    ) -> None:
        self._events = events
        self._first = first
        self._fmt = fmt
        self._tracker = tracker
        self._shutdown = shutdown
        self.status = CLIENT_CLOSED  # unless the stream runs to its end
        self._closed = False
        self._pending: asyncio.Future[TokenEvent | None] | None = None

    async def chunks(self) -> AsyncGenerator[str, None]:
        fmt, tracker = self._fmt, self._tracker
        try:
            for chunk in fmt.opening_chunks():
                yield sse_event(chunk)
            event = self._first
            while True:
                tracker.on_event(event)
                if event.text:
                    yield sse_event(fmt.content_chunk(event.text))
                if event.finished:
                    break
                event = check_event(await self._next_event())
            yield sse_event(fmt.final_chunk(tracker.finish_reason))
            if fmt.include_usage:
                yield sse_event(fmt.usage_chunk(tracker.usage()))
            self.status = 200
            yield SSE_DONE
        except Exception as exc:
            error = as_api_error(exc, tracker.request_id)
            self.status = error.status
            yield sse_event(error.body())
            yield SSE_DONE
        finally:
            await self.close()

    async def _next_event(self) -> TokenEvent | None:
        """The backend's next event, fetched in a task of its own.

        Starlette stops a stream whose client left by cancelling an anyio scope, which re-cancels
        every later await in that scope; were the backend iterated here, its cleanup (telling the
        mesh to cancel) could not await anything. ``close`` cancels this task instead, once.
        The router shutting down ends the wait with its 503 ``APIError``.
        """
        self._pending = asyncio.ensure_future(_anext_or_none(self._events))
        stopping = self._shutdown.future()
        await asyncio.wait({self._pending, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not self._pending.done():
            raise self._shutdown.error()
        return self._pending.result()

    async def close(self) -> None:
        """Close the backend iterator (cancelling an unfinished request) and record the outcome."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._pending is not None and not self._pending.done():
                self._pending.cancel()
                await asyncio.wait([self._pending])
        await aclose(self._events)
        self._tracker.finish(self.status)
        self._tracker.metrics.count(self._tracker.endpoint, self.status)


class EventStreamResponse(StreamingResponse):
    """SSE whose stream is closed however the response ends: completed, failed or client gone."""

    media_type = "text/event-stream"

    def __init__(self, stream: EventStream) -> None:
        self._chunks = stream.chunks()
        self._stream = stream
        super().__init__(self._chunks, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._chunks.aclose()
                await self._stream.close()
