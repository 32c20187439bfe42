"""Shutting the router down ends what is in flight: every open SSE stream gets an error event and
``[DONE]``, every waiting non-streamed request a 503, new ones are refused, and the server stops
within about two seconds. In this process first, then a real router process and its signals."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from kvmesh.infra.processes import ManagedProcess
from kvmesh.services.router.app import create_app
from kvmesh.services.router.limits import Limits
from tests.router.fakes import Emit, FakeBackend, Finish, Sleep
from tests.router.served import Served, served

MODEL = "tiny-llama"
REPO = Path(__file__).resolve().parents[2]
SHUTTING_DOWN = {
    "error": {
        "message": "the server is shutting down",
        "type": "service_unavailable",
        "param": None,
        "code": "unavailable",
    }
}


def slow_script(tokens: int = 200, interval: float = 0.05) -> list:
    return [*[s for _ in range(tokens) for s in (Emit((5,), "tok"), Sleep(interval))], Finish("length")]


async def read_stream(url: str, path: str, payload: dict, on_first: asyncio.Event) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order, until the server ends it."""
    datas: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        async with client.stream("POST", path, json={**payload, "stream": True}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    datas.append(line[len("data: ") :])
                    if any('"tok"' in d for d in datas):
                        on_first.set()
    return datas


async def post(url: str, path: str, payload: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        return await client.post(path, json=payload)


def assert_ended_by_shutdown(datas: list[str]) -> None:
    assert datas[-1] == "[DONE]", datas[-3:]
    assert json.loads(datas[-2]) == SHUTTING_DOWN
    assert all("error" not in json.loads(d) for d in datas[:-2])
    assert any('"tok"' in d for d in datas[:-2])  # it was really streaming


# --------------------------------------------------------------------------- in this process
@pytest.fixture
async def router(fake: FakeBackend) -> AsyncIterator[Served]:
    fake.script = slow_script()
    async with served(create_app(fake), Limits()) as s:
        yield s


async def test_shutdown_ends_streams_and_waiting_requests(router: Served, fake: FakeBackend) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    first_chat, first_completion = asyncio.Event(), asyncio.Event()
    streams = [
        asyncio.create_task(read_stream(router.url, "/v1/chat/completions", chat, first_chat)),
        asyncio.create_task(read_stream(router.url, "/v1/completions", {"model": MODEL, "prompt": "x"}, first_completion)),
    ]
    waiting = asyncio.create_task(post(router.url, "/v1/completions", {"model": MODEL, "prompt": "x"}))
    await asyncio.wait_for(asyncio.gather(first_chat.wait(), first_completion.wait()), 5)

    router.server.begin_shutdown()
    seconds = await router.wait_stopped(timeout=3)

    for stream in streams:
        assert_ended_by_shutdown(await stream)
    response = await waiting
    assert (response.status_code, response.json()) == (503, SHUTTING_DOWN)
    assert seconds < 2.0
    assert sorted(fake.cancelled) == sorted(call.request_id for call in fake.calls)  # the mesh is told
    assert len(fake.calls) == 3
    with pytest.raises(httpx.ConnectError):
        await post(router.url, "/v1/completions", {"model": MODEL, "prompt": "x"})


async def test_shutdown_before_the_first_token_is_a_503(router: Served, fake: FakeBackend) -> None:
    fake.script = [Sleep(30), *slow_script()]
    request = asyncio.create_task(
        post(router.url, "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True})
    )
    while not fake.calls:
        await asyncio.sleep(0.01)
    router.server.begin_shutdown()
    response = await asyncio.wait_for(request, 3)
    assert (response.status_code, response.json()) == (503, SHUTTING_DOWN)
    assert fake.cancelled == [fake.calls[0].request_id]


async def test_once_shutting_down_new_requests_and_readiness_are_refused(fake: FakeBackend) -> None:
    app = create_app(fake)
    app.state.shutdown.begin()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert (resp.status_code, resp.json()) == (503, SHUTTING_DOWN)
        assert ((await client.get("/health/ready")).status_code, (await client.get("/health")).status_code) == (503, 503)
        assert (await client.get("/health/live")).status_code == 200
    assert fake.calls == []


# --------------------------------------------------------------------------- a real process
@pytest.fixture
def fake_router(tmp_path: Path, tiny_model_dir: Path) -> ManagedProcess:
    process = ManagedProcess(
        "fake-router",
        [sys.executable, "-m", "tests.router.fake_router", "--model-dir", str(tiny_model_dir), "--tokens", "400"],
        log_path=tmp_path / "fake-router.log",
        cwd=REPO,
    )
    yield process
    process.stop(grace=5)


async def both_in_flight(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        while "kvmesh_router_requests_in_flight 2.0" not in (await client.get("/metrics")).text:
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_ends_the_router_process_cleanly(fake_router: ManagedProcess, signum: int) -> None:
    line = await asyncio.to_thread(fake_router.wait_for_line, lambda text: "fake router listening on" in text, 60)
    url = re.search(r"(http://\S+)", line).group(1)
    first = asyncio.Event()
    stream = asyncio.create_task(read_stream(url, "/v1/completions", {"model": MODEL, "prompt": "x"}, first))
    waiting = asyncio.create_task(post(url, "/v1/completions", {"model": MODEL, "prompt": "x"}))
    await asyncio.wait_for(first.wait(), 10)
    await asyncio.wait_for(both_in_flight(url), 10)  # the second too (on a busy machine it came after the first token)

    fake_router.signal(signum)
    started = time.monotonic()
    code = await asyncio.to_thread(fake_router.popen.wait, 5)
    seconds = time.monotonic() - started

    assert_ended_by_shutdown(await stream)
    response = await waiting
    assert (response.status_code, response.json()) == (503, SHUTTING_DOWN)
    assert code == 0, fake_router.tail()
    assert seconds < 2.5, fake_router.tail()
    await asyncio.to_thread(fake_router.wait_for_line, lambda text: "fake router stopped: 2 cancelled" in text, 5)
