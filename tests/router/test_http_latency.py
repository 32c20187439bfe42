"""The router's HTTP server sends a stream's first chunk at once: its connections have Nagle's
algorithm off (``TCP_NODELAY``). With it on, the chunk written just after a response's headers
waited for the client's delayed ACK of them (40 ms or more on Linux) on every request of a
kept-alive connection: most of what the mesh added to the time to first token."""

from __future__ import annotations

import socket
import time

import httpx

from kvmesh.services.router.app import create_app
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
