"""uvicorn's h11 protocol with the router's limits on the request head, and a lingering close.

What plain uvicorn (h11, the only implementation installed) does, and what this changes:

- A request head larger than ``h11_max_incomplete_event_size`` (16 KiB by default) makes h11
  raise ``RemoteProtocolError(error_status_hint=431)``; uvicorn answers a plain-text 400 and
  closes the socket at once, with the rest of the head unread, so the kernel resets the
  connection and a client still sending (a 1 MB header) sees ``ECONNRESET``, not the answer.
  A head that arrives whole in one read is not checked at all (20 KB passes). Here the limit
  is ``Limits.max_header_bytes``, also checked on every complete head, and the answer is the
  431 h11 hints at, with an OpenAI error body.
- Any answer given before the client finished sending (that 431, a 400 for a malformed
  request, the app's 413 or 408) is followed by a lingering close, as nginx does: the
  response is sent with FIN (``write_eof``), what the client still sends is read and
  dropped, never parsed or buffered, and the connection is closed when the client closes it
  or after ``Limits.linger_seconds``. The client gets to read the answer.
- A request head that does not arrive within ``Limits.header_timeout`` seconds of its first
  byte (or of the connection opening) gets a 408; uvicorn waits for ever.
- A response's head is written together with what follows it (``HeadWithBody``): uvicorn
  wrote it alone, a send and a TCP segment (and a wake-up of the client) before the body,
  which was ready by then: a stream's first chunk, a JSON answer.
"""

from __future__ import annotations

import asyncio
import functools
import http
import logging
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvmesh.services.router.limits import Limits
from kvmesh.services.router.openai_api import error_body, error_json

__all__ = ["RouterHTTPProtocol", "router_protocol"]

logger = logging.getLogger(__name__)


def _head_size(request: h11.Request) -> int:
    """The bytes of a request line and its header fields, as sent (give or take whitespace)."""
    size = len(request.method) + len(request.target) + len(b" HTTP/1.1\r\n") + 2
    return size + sum(len(name) + len(value) + 4 for name, value in request.headers)


class _LimitedConnection(h11.Connection):
    """h11's server side, refusing a complete request head larger than the limit too; the last
    protocol error is kept for the answer."""

    def __init__(self, max_head: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head)
        self.max_head = max_head
        self.error: h11.RemoteProtocolError | None = None
        self.on_response_head: Callable[[], None] = lambda: None  # a response's head was just made

    def send_with_data_passthrough(self, event: Any) -> list[bytes] | None:  # what ``send`` calls
        data = super().send_with_data_passthrough(event)
        if isinstance(event, h11.Response):
            self.on_response_head()
        return data

    def next_event(self) -> Any:
        try:
            event = super().next_event()
            if isinstance(event, h11.Request) and _head_size(event) > self.max_head:
                raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
        except h11.RemoteProtocolError as exc:
            self.error = exc
            raise
        return event


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


class RouterHTTPProtocol(H11Protocol):
    """``H11Protocol`` with the router's head limit, head timeout and lingering close, and
    each response's head written with what follows it."""

    def __init__(self, *args: Any, limits: Limits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.conn = self._conn = _LimitedConnection(limits.max_header_bytes)
        self._lingering = False
        self._linger_timer: asyncio.TimerHandle | None = None
        self._head_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self.transport = HeadWithBody(self.transport, self.loop)  # what the request cycles write to
        self._conn.on_response_head = self.transport.hold_next
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # dropped: the answer has been given
        try:
            super().data_received(data)
        except Exception:
            logger.warning("unparseable HTTP request", exc_info=True)
            self._reject(400, "Invalid HTTP request.", "invalid_request")
            return
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()  # a whole head has arrived

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    # -- uvicorn hooks ---------------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        """h11 refused what the client sent: a 431 for a head too large, else a 400."""
        error: h11.RemoteProtocolError | None = getattr(self.conn, "error", None)
        if error is not None and error.error_status_hint == 431:
            limit = self.limits.max_header_bytes
            self._reject(
                431,
                f"The request's header fields are larger than this server accepts ({limit} bytes).",
                "request_header_fields_too_large",
            )
        else:
            self._reject(400, f"Invalid HTTP request: {error or msg}", "invalid_request")

    def on_response_complete(self) -> None:
        if not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
            self.server_state.total_requests += 1
            self._linger()  # answered before the body was read: a 413 or 408
            return
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # the next request on this connection

    def shutdown(self) -> None:
        if self._lingering:
            self.transport.close()
            return
        super().shutdown()

    # -- ours ------------------------------------------------------------------------------
    def _reject(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` with an OpenAI error body, bypassing h11 (whose state may be ERROR)."""
        if self.transport.is_closing():
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
        if self._lingering or self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        pending, _ = self.conn.trailing_data
        if not pending:  # an idle connection: nothing to answer
            self.transport.close()
            return
        seconds = self.limits.header_timeout
        self._reject(408, f"The request head did not arrive within {seconds:g} seconds.", "request_timeout")


def router_protocol(limits: Limits) -> Callable[..., RouterHTTPProtocol]:
    """What ``uvicorn.Config(http=...)`` takes: the protocol class bound to ``limits``."""
    return functools.partial(RouterHTTPProtocol, limits=limits)
