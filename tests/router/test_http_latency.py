"""The router's HTTP server sends a stream's first chunk at once: its connections have Nagle's
algorithm off (``TCP_NODELAY``). With it on, the chunk written just after a response's headers
waited for the client's delayed ACK of them (40 ms or more on Linux) on every request of a
kept-alive connection: most of what the mesh added to the time to first token. And a response's
head leaves with what follows it, not in a send of its own (``HeadWithBody``)."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx

from kvmesh.services.router.app import create_app
from kvmesh.services.router.http_protocol import HeadWithBody
from kvmesh.services.router.limits import Limits
from kvmesh.services.router.server import bind
from tests.router.fakes import Emit, FakeBackend, Finish, Sleep
from tests.router.served import served

MODEL = "tiny-llama"


def test_the_listening_socket_says_tcp() -> None:
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP  # what asyncio looks at before it sets TCP_NODELAY
    finally:
        sock.close()


async def test_connections_have_nagle_off_and_the_first_chunk_follows_the_headers(fake: FakeBackend) -> None:
    # the first token after a "prefill": the response (headers and first chunk) starts only then
    fake.script = [Sleep(0.1), Emit((5,), "Hi"), Sleep(0.05), Emit((6,), " there"), Finish("length")]
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "stream": True}
    gaps = []
    async with served(create_app(fake), Limits()) as router:
        async with httpx.AsyncClient(base_url=router.url, timeout=10, trust_env=False) as client:
            for _ in range(4):  # one connection, kept alive: the first request's ACK is quick anyway
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    headers_at = time.perf_counter()
                    first_at = None
                    async for line in response.aiter_lines():
                        if first_at is None and line.startswith("data: ") and '"Hi"' in line:
                            first_at = time.perf_counter()
                    assert first_at is not None
                    gaps.append(first_at - headers_at)
                connections = list(router.server.server_state.connections)
                assert len(connections) == 1
                server_side = connections[0].transport.get_extra_info("socket")
                assert server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    # with Nagle on, each kept-alive request's gap was the delayed ACK (>= 40 ms)
    assert min(gaps[1:]) < 0.02, [round(g * 1e3, 1) for g in gaps]


class Recorder(asyncio.Transport):
    """What a transport was asked to do, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("write", bytes(data)))

    def write_eof(self) -> None:
        self.calls.append(("eof", b""))

    def close(self) -> None:
        self.calls.append(("close", b""))
        self.closing = True

    def abort(self) -> None:
        self.calls.append(("abort", b""))
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing


async def test_a_response_head_goes_out_with_what_follows_it() -> None:
    loop = asyncio.get_running_loop()
    raw = Recorder()
    transport = HeadWithBody(raw, loop)
    transport.write(b"before")  # not a head: as is
    transport.hold_next()
    transport.write(b"HEAD")
    assert raw.calls == [("write", b"before")]
    transport.write(b"body")
    assert raw.calls[1:] == [("write", b"HEADbody")]  # one send
    await asyncio.sleep(0)
    assert len(raw.calls) == 2  # nothing left to flush

    # a body that is not ready at once: the head goes out alone on the loop's next turn
    transport.hold_next()
    transport.write(b"HEAD2")
    await asyncio.sleep(0)
    assert raw.calls[2:] == [("write", b"HEAD2")]
    transport.write(b"late body")
    assert raw.calls[3:] == [("write", b"late body")]

    # held when the connection ends its sending or closes: written first
    for end, kind in ((transport.write_eof, "eof"), (transport.close, "close")):
        raw.calls.clear()
        transport.hold_next()
        transport.write(b"HEAD3")
        end()
        assert raw.calls == [("write", b"HEAD3"), (kind, b"")]
        raw.closing = False
    raw.calls.clear()
    transport.hold_next()
    transport.write(b"HEAD4")
    transport.abort()  # dropped, as abort drops what is buffered
    await asyncio.sleep(0)
    assert raw.calls == [("abort", b"")]


async def test_the_server_sends_a_head_with_the_first_chunk_or_the_whole_answer(fake: FakeBackend) -> None:
    """The response head and a stream's first chunk (or a JSON answer) leave in one send."""
    fake.script = [Emit((5,), "Hi"), Sleep(0.05), Emit((6,), " there"), Finish("length")]
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
    async with served(create_app(fake), Limits()) as router:
        async with httpx.AsyncClient(base_url=router.url, timeout=10, trust_env=False) as client:
            assert (await client.post("/v1/completions", json=body)).status_code == 200  # the connection
            (connection,) = router.server.server_state.connections
            assert isinstance(connection.transport, HeadWithBody)
            raw = connection.transport._transport
            sent: list[bytes] = []
            write = raw.write

            def recorded(data) -> None:  # type: ignore[no-untyped-def]
                sent.append(bytes(data))
                write(data)

            raw.write = recorded  # type: ignore[method-assign]
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                lines = [line async for line in response.aiter_lines() if line]
            assert response.status_code == 200 and lines[-1] == "data: [DONE]"
            assert sent[0].startswith(b"HTTP/1.1 200 ") and b'data: {"id"' in sent[0] and b'"text":"Hi"' in sent[0]
            sent.clear()
            answer = await client.post("/v1/completions", json=body)
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "Hi there"
            sent = [data for data in sent if data]  # the end of a body of known length is b""
            assert len(sent) == 1 and sent[0].startswith(b"HTTP/1.1 200 ") and sent[0].endswith(answer.content)
