"""Limits that need a real socket: the router's HTTP server in this process on port 0, and raw
TCP clients where httpx would hide what the server does (resets, half-sent requests)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from kvmesh.services.router.app import create_app
from kvmesh.services.router.limits import Limits
from tests.router.fakes import FakeBackend
from tests.router.served import Served, served

MODEL = "tiny-llama"
LIMITS = Limits(max_body_bytes=64 * 1024, body_timeout=0.5, max_header_bytes=16 * 1024, header_timeout=0.5, linger_seconds=1.0)


@pytest.fixture
async def router(fake: FakeBackend) -> AsyncIterator[Served]:
    async with served(create_app(fake, limits=LIMITS), LIMITS) as s:
        yield s


async def raw_exchange(served_: Served, data: bytes, *, read_timeout: float = 5.0) -> tuple[bytes, float]:
    """Send ``data``, then read until the server closes: everything it sent, and when it closed."""
    reader, writer = await asyncio.open_connection(served_.host, served_.port)
    started = time.monotonic()
    try:
        writer.write(data)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), read_timeout)  # to EOF
        return answer, time.monotonic() - started
    finally:
        writer.close()


def parse(answer: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("ascii").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)


def error(message: str, code: str, type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


HEADERS_TOO_LARGE = error(
    "The request's header fields are larger than this server accepts (16384 bytes).",
    "request_header_fields_too_large",
)


# --------------------------------------------------------------------------- headers
@pytest.mark.parametrize("size", [20_000, 1_000_000])
async def test_a_large_header_is_431_and_the_client_reads_it(router: Served, size: int) -> None:
    """20 KB arrives in one read, 1 MB in many: both are answered, and the client still sending
    reads the answer (plain uvicorn let 20 KB through with h11 and reset the connection on 1 MB)."""
    async with httpx.AsyncClient(base_url=router.url, timeout=5) as client:
        resp = await client.get("/health", headers={"x-big": "a" * size})
        assert (resp.status_code, resp.json()) == (431, HEADERS_TOO_LARGE)
        assert resp.headers["connection"] == "close"
        assert (await client.get("/health")).status_code == 200  # a new connection serves


async def test_a_large_head_still_arriving_is_431_before_it_ends(router: Served) -> None:
    """The parser holds a header field until it ends: the bytes of a head still arriving are
    bounded too (a client could otherwise send one header line for ever)."""
    reader, writer = await asyncio.open_connection(router.host, router.port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        for _ in range(20):  # 20 KB of one header value, in pieces, never ended
            writer.write(b"a" * 1024)
            await writer.drain()
            await asyncio.sleep(0.01)
        answer = await asyncio.wait_for(reader.read(), 5)  # the 431, then FIN
    finally:
        writer.close()
    status, headers, body = parse(answer)
    assert (status, body) == (431, HEADERS_TOO_LARGE)
    assert headers["connection"] == "close"


async def test_pipelined_requests_are_answered_in_order(router: Served) -> None:
    reader, writer = await asyncio.open_connection(router.host, router.port)
    try:
        writer.write(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\nGET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = b""
        while answers.count(b"HTTP/1.1 200 OK") < 2 or not answers.endswith(b"}"):
            answers += await asyncio.wait_for(reader.read(65536), 5)
    finally:
        writer.close()
    first, second = answers.split(b"HTTP/1.1 200 OK")[1:]
    assert first.endswith(b'{"status":"alive"}') and b'"version"' in second


@pytest.mark.parametrize(
    "upgrade",
    [
        b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n",
        b"Upgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n",
    ],
    ids=["websocket", "h2c"],
)
async def test_an_upgrade_request_is_answered(router: Served, upgrade: bytes) -> None:
    """The router serves no WebSocket and no HTTP/2: an upgrade request still gets an answer
    (a refused handshake, or the plain HTTP one), never a connection left waiting."""
    reader, writer = await asyncio.open_connection(router.host, router.port)
    try:
        writer.write(b"GET /health/live HTTP/1.1\r\nHost: x\r\n" + upgrade + b"\r\n")
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 ")
    assert not answer.startswith(b"HTTP/1.1 101")  # nothing was switched to


async def test_a_header_within_the_limit_is_served(router: Served) -> None:
    async with httpx.AsyncClient(base_url=router.url, timeout=5) as client:
        assert (await client.get("/health", headers={"x-big": "a" * 15_000})).status_code == 200


async def test_a_malformed_request_is_a_json_400(router: Served) -> None:
    answer, _ = await raw_exchange(router, b"GET / HTTP/1.1\r\nno colon here\r\n\r\n")
    status, headers, body = parse(answer)
    assert (status, headers["content-type"]) == (400, "application/json")
    assert body["error"]["code"] == "invalid_request"
    assert body["error"]["message"].startswith("Invalid HTTP request: ")


# --------------------------------------------------------------------------- time
async def test_a_short_body_with_a_long_content_length_is_408_then_closed(router: Served, fake: FakeBackend) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    answer, seconds = await raw_exchange(router, head + b'{"model"')
    status, _, body = parse(answer)
    assert (status, body) == (
        408,
        error("The request body did not arrive within 0.5 seconds.", "request_timeout"),
    )
    assert 0.5 <= seconds < 2.0  # read() returned: the server closed the connection
    assert fake.calls == []


async def test_a_head_that_never_ends_is_408(router: Served) -> None:
    answer, seconds = await raw_exchange(router, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: 1")
    status, _, body = parse(answer)
    assert (status, body) == (408, error("The request head did not arrive within 0.5 seconds.", "request_timeout"))
    assert 0.5 <= seconds < 2.0


async def test_an_idle_connection_is_closed(router: Served) -> None:
    answer, seconds = await raw_exchange(router, b"")
    assert answer == b""
    assert 0.5 <= seconds < 2.0


# --------------------------------------------------------------------------- body size
BODY_TOO_LARGE = error("The request body is larger than this server accepts (65536 bytes).", "request_too_large")


async def timed_health(url: str, stop: asyncio.Event) -> list[float]:
    """``GET /health`` again and again until ``stop``: each one's seconds."""
    times = []
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        while not stop.is_set():
            started = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            times.append(time.monotonic() - started)
            await asyncio.sleep(0.01)
    return times


async def test_a_large_body_is_413_from_its_content_length(router: Served, fake: FakeBackend) -> None:
    """The server never reads the body: ``/health`` on another connection stays fast (loosely
    bounded here, where client and server share one event loop; tests/mesh/test_router_limits.py
    holds a real router to 100 ms)."""
    body = b'{"model": "tiny-llama", "prompt": "' + b"a" * 32 * 1024 * 1024 + b'"}'
    stop = asyncio.Event()
    health = asyncio.create_task(timed_health(router.url, stop))
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        resp = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    stop.set()
    times = await health
    assert (resp.status_code, resp.json()) == (413, BODY_TOO_LARGE)
    assert max(times) < 0.25, times
    assert fake.calls == []


async def test_a_large_chunked_body_is_413_as_it_passes_the_limit(router: Served, fake: FakeBackend) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(512):
            yield b"a" * 64 * 1024  # 32 MiB in all
        yield b'"}'

    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        resp = await client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert (resp.status_code, resp.json()) == (413, BODY_TOO_LARGE)
    assert fake.calls == []


async def test_after_an_early_answer_the_connection_lingers_a_bounded_time(router: Served) -> None:
    """A client that announces 100 MB, reads the 413 and then neither sends nor closes is
    closed by the server after ``linger_seconds``."""
    reader, writer = await asyncio.open_connection(router.host, router.port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)  # the 413, then FIN
        assert parse(answer)[:1] == (413,)
        assert len(router.server.server_state.connections) == 1  # half-closed, lingering
        deadline = time.monotonic() + 3
        while router.server.server_state.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not router.server.server_state.connections
    finally:
        writer.close()


async def test_a_normal_request_still_keeps_its_connection(router: Served) -> None:
    async with httpx.AsyncClient(base_url=router.url, timeout=5) as client:
        for _ in range(3):
            resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert resp.status_code == 200
    assert router.server.server_state.total_requests == 3
