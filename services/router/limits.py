"""Bounds on what a client may send the router: body size, header size, and time to send them.

``Limits`` is the one settings object for them (checked once); ``BodyLimit`` is the ASGI
middleware that enforces the body's: a ``Content-Length`` over the limit is answered 413 before
a byte of the body is read, a chunked body is counted as it arrives and answered 413 as soon as
it passes the limit (the rest is never read into memory), and a body that does not arrive within
``body_timeout`` seconds is answered 408. The header limit is the HTTP protocol's job
(``http_protocol``). Each answer carries the OpenAI error body and the connection is closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmesh.services.router.metrics import RouterMetrics
from kvmesh.services.router.openai_api import APIError, error_json

__all__ = ["BodyLimit", "Limits", "answer_error", "read_body", "replayed"]

logger = logging.getLogger(__name__)

MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may be. Defaults suit an OpenAI-style API on one machine."""

    max_body_bytes: int = 4 * MiB
    body_timeout: float = 10.0  # seconds from the request's head to the end of its body
    max_header_bytes: int = 32 * 1024  # the request line and all header fields together
    header_timeout: float = 10.0  # seconds for a request's head, once its first byte arrived
    linger_seconds: float = 10.0  # after an early answer, how long the unread rest is drained

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        for name in ("body_timeout", "header_timeout", "linger_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server accepts ({limit} bytes).",
        code="request_too_large",
    )


def body_timed_out(seconds: float) -> APIError:
    return APIError(
        408, f"The request body did not arrive within {seconds:g} seconds.", code="request_timeout"
    )


async def read_body(receive: Receive, *, limit: int, timeout: float) -> tuple[bytes, Message | None]:
    """The whole body, at most ``limit`` bytes, within ``timeout`` seconds.

    Returns the body and, when the client left while sending it, the ``http.disconnect``
    message to pass on. Raises ``APIError`` 413 past ``limit`` and 408 past ``timeout``; what
    was read so far is dropped either way.
    """
    chunks: list[bytes] = []
    size = 0
    # a timeout in this task, not ``wait_for``'s task per read: the body has mostly arrived
    # with the head, and a task and a turn of the event loop were a stream's first token's
    within = asyncio.timeout(timeout)
    try:
        async with within:
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return b"", message  # gone mid-body
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks), None
    except TimeoutError:
        if within.expired():
            raise body_timed_out(timeout) from None
        raise


class AnsweringMiddleware:
    """Base of the router's ASGI middlewares that answer some requests themselves with an
    error: one to ``counted_paths`` (the generation endpoints) is counted in ``metrics`` with
    its status, as the app counts its own answers."""

    def __init__(self, app: ASGIApp, *, metrics: RouterMetrics, counted_paths: Collection[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.counted_paths = counted_paths

    async def answer(self, scope: Scope, send: Send, error: APIError) -> None:
        if scope["path"] in self.counted_paths:
            self.metrics.count(scope["path"], error.status)
        await answer_error(send, error)


class BodyLimit(AnsweringMiddleware):
    """ASGI middleware: the body is read here, within ``Limits``, then replayed to the app."""

    def __init__(self, app: ASGIApp, *, limits: Limits, metrics: RouterMetrics, counted_paths: Collection[str]) -> None:
        super().__init__(app, metrics=metrics, counted_paths=counted_paths)
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if "content-length" not in headers and "transfer-encoding" not in headers:
            await self.app(scope, receive, send)  # no body (HTTP/1.1 frames a request body by these two only)
            return
        limit = self.limits.max_body_bytes
        try:
            declared = headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise too_large(limit)
            body, gone = await read_body(receive, limit=limit, timeout=self.limits.body_timeout)
        except APIError as error:
            logger.info("%s %s rejected: %d %s", scope["method"], scope["path"], error.status, error.message)
            await self.answer(scope, send, error)
            return
        await self.app(scope, replayed(gone or {"type": "http.request", "body": body, "more_body": False}, receive), send)


def replayed(first: Message, receive: Receive) -> Receive:
    """``receive`` with ``first`` (a message already taken from it) given out again first."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return first
        return await receive()

    return replay


async def answer_error(send: Send, error: APIError) -> None:
    """The error response. No ``Connection: close``: a server that closed now, with the body's
    rest unread, would reset the connection and the client could miss the answer; the HTTP
    protocol (``http_protocol``) drains that rest for a bounded time, then closes."""
    content = error_json(error.body())
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(content)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": content})
