"""uvicorn's httptools protocol with the router's limits on the request head, and a lingering close.

The router is served on httptools (llhttp, in C), not h11 (pure Python): on the AVX2-only
Zen 3 its first chunk after an idle moment came 0.09–0.39 ms sooner (docs/benchmarks.md, "The
router on httptools"). What plain uvicorn on httptools does, and what this changes:

- A request head of any size is parsed: httptools holds a header field until it ends, so one
  endless header line grows the server's memory for as long as the client sends it. Here the
  limit is ``Limits.max_header_bytes``, checked on the head's fields as they are parsed and on
  the bytes of a head still arriving, and the answer is a 431 with an OpenAI error body.
- A malformed request gets a plain-text 400 and the socket closed at once, so the kernel may
  reset the connection before the client reads it. Here it is a JSON 400 naming the parser's
  complaint.
- Any answer given before the client finished sending (those 431s and 400s, the app's 413
  or 408) is followed by a lingering close, as nginx does: the response is sent with FIN
  (``write_eof``), what the client still sends is read and dropped, never parsed or buffered,
  and the connection is closed when the client closes it or after ``Limits.linger_seconds``.
  The client gets to read the answer.
- A request head that does not arrive within ``Limits.header_timeout`` seconds of its first
  byte (or of the connection opening, or of the last answer on it) gets a 408, and an idle
  connection is closed then; uvicorn waits for a head for ever.
- A response's head is written together with what follows it (``HeadWithBody``): uvicorn
  writes it alone, a send and a TCP segment (and a wake-up of the client) before the body,
  which is ready by then: a stream's first chunk, a JSON answer.
"""

from __future__ import annotations

import asyncio
import functools
import http
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httptools  # type: ignore[import-untyped]
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvmesh.services.router.limits import Limits
from kvmesh.services.router.openai_api import error_body, error_json

__all__ = ["RouterHTTPProtocol", "router_protocol"]

logger = logging.getLogger(__name__)


IDLE, HEAD, BODY = "idle", "head", "body"  # where the request being received is


class HeadWithBody(asyncio.Transport):
    """A connection's transport that holds a response's head (the write after
    ``hold_next``) back until the next write, which takes it along in one send, or until
    the connection is closed or ends its sending, or the event loop's next turn at the
    latest: a body that is not ready at once is not waited for. Bytes go out in the order
    they were written."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._hold_next = False
        self._held: bytes | None = None

    def hold_next(self) -> None:
        self._hold_next = True

    def flush(self) -> None:
        """Write what is held back, if anything."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._hold_next:
            self._hold_next = False
            if data and self._held is None:
                self._held = bytes(data)
                self._loop.call_soon(self.flush)
                return
        if self._held is not None:
            data, self._held = self._held + bytes(data), None
        self._transport.write(data)

    def writelines(self, list_of_data: Any) -> None:
        self.flush()
        self._transport.writelines(list_of_data)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    # the rest as the transport has it
    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()


class RouterHTTPProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with the router's head limit, head timeout and lingering close,
    and each response's head written with what follows it."""

    def __init__(self, *args: Any, limits: Limits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._phase: str = IDLE  # of the request being received: IDLE, HEAD or BODY
        self._head_size = 0  # the request line's and header fields' bytes, as parsed
        self._head_read = 0  # bytes read while in the head (a bound on what the parser holds)
        self._too_large = False
        self._lingering = False
        self._linger_timer: asyncio.TimerHandle | None = None
        self._head_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self.head_with_body = HeadWithBody(self.transport, self.loop)
        self.transport = self.head_with_body  # what the request cycles write to
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # dropped: the answer has been given
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():  # a WebSocket library is installed: it refuses the handshake (no such route)
                self.handle_websocket_upgrade()
            else:  # any other upgrade (h2c): answered in HTTP/1.1
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            if self._too_large:
                self._reject_large_head()
            else:
                logger.warning("unparseable HTTP request: %s", exc)
                self._reject(400, f"Invalid HTTP request: {exc}", "invalid_request")
            return
        if self._lingering or self._phase != HEAD:
            return
        self._head_read += len(data)
        if self._head_read > self.limits.max_header_bytes:  # a head that is still arriving
            self._reject_large_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    # -- httptools' callbacks --------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = HEAD
        self._head_size = self._head_read = 0

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._phase = BODY
        self._cancel_head_timer()  # a whole head has arrived
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # this request's: hold its response's head
            cycle.send = functools.partial(_holding_head, cycle.send, self.head_with_body)  # type: ignore[method-assign]

    def on_message_complete(self) -> None:
        self._phase = IDLE
        super().on_message_complete()

    # -- uvicorn hooks ---------------------------------------------------------------------
    def on_response_complete(self) -> None:
        if not self.transport.is_closing() and self._phase == BODY and not self.pipeline:
            self.server_state.total_requests += 1
            self._linger()  # answered before the body was read: a 413 or 408
            return
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()  # the next request on this connection

    def shutdown(self) -> None:
        if self._lingering:
            self.transport.close()
            return
        super().shutdown()

    # -- ours ------------------------------------------------------------------------------
    def _count_head(self, size: int) -> None:
        self._head_size += size
        if self._head_size > self.limits.max_header_bytes:
            self._too_large = True
            raise HeadTooLarge()  # the parser stops (``data_received`` answers)

    def _reject_large_head(self) -> None:
        limit = self.limits.max_header_bytes
        self._reject(
            431,
            f"The request's header fields are larger than this server accepts ({limit} bytes).",
            "request_header_fields_too_large",
        )

    def _reject(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` with an OpenAI error body, bypassing the request cycle (there may be none)."""
        if self.transport.is_closing() or self._lingering:
            return
        body = error_json(error_body(status, message, code=code))
        head = (
            f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        )
        self.transport.write(head.encode("ascii") + body)
        self._linger()

    def _linger(self) -> None:
        """Send FIN after the answer, drop whatever else arrives, close in a bounded time."""
        if self._lingering:
            return
        self._lingering = True
        self._cancel_head_timer()
        self._unset_keepalive_if_required()
        if self.transport.is_closing():
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        if not self.transport.is_reading():
            self.transport.resume_reading()
        self._linger_timer = self.loop.call_later(self.limits.linger_seconds, self.transport.close)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._lingering or self.transport.is_closing() or self._phase == BODY:
            return
        if self._phase == IDLE:  # an idle connection: nothing to answer
            self.transport.close()
            return
        seconds = self.limits.header_timeout
        self._reject(408, f"The request head did not arrive within {seconds:g} seconds.", "request_timeout")


class HeadTooLarge(Exception):
    """Raised in a parser callback to stop parsing a head over the limit."""


async def _holding_head(send: Callable[[Any], Awaitable[None]], transport: HeadWithBody, message: Any) -> None:
    """A request cycle's ``send``: the response's head is held back for what follows it."""
    if message["type"] == "http.response.start":
        transport.hold_next()
    await send(message)


def router_protocol(limits: Limits) -> Callable[..., RouterHTTPProtocol]:
    """What ``uvicorn.Config(http=...)`` takes: the protocol class bound to ``limits``."""
    return functools.partial(RouterHTTPProtocol, limits=limits)
