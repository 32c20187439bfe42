"""The router's input limits and shutdown through a real mesh (router and workers as processes):
a 100 MB body is refused with a 413 while the router stays small and ``/health`` stays fast;
oversized stop strings and lone surrogates are 400s, never a 500; the mesh still serves after
all of it; and SIGTERM ends a live stream with an error event and ``[DONE]``."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from kvmesh.infra.local_mesh import LocalMesh
from tests.mesh.client import post

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MB = 1_000_000
REPO = Path(__file__).resolve().parents[2]
LONE = "a\\ud800b"  # a lone surrogate as a JSON escape
GREEDY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


class HealthWatch:
    """``tests.router.health_watch`` in a process of its own: ``/health`` latencies and the router's RSS."""

    def __init__(self, url: str, pid: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.router.health_watch", url, str(pid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
        )

    def results(self) -> dict[str, list]:
        out, _ = self.process.communicate(b"", timeout=30)  # closing stdin stops it
        assert self.process.returncode == 0
        return json.loads(out)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)


async def huge_body_answer(mesh: LocalMesh, *, chunked: bool) -> httpx.Response:
    head, tail = b'{"model": "' + MODEL.encode() + b'", "prompt": "', b'"}'
    piece = b"a" * MB

    async def chunks() -> AsyncIterator[bytes]:
        yield head
        for _ in range(100):
            yield piece
        yield tail

    content = chunks() if chunked else head + piece * 100 + tail
    async with httpx.AsyncClient(base_url=mesh.base_url, timeout=60) as client:
        return await client.post("/v1/completions", content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_100_mb_body_is_413_and_the_router_stays_small_and_responsive(mesh: LocalMesh, chunked: bool) -> None:
    assert mesh.router is not None
    watch = HealthWatch(mesh.base_url, mesh.router.pid)
    try:
        await asyncio.sleep(0.3)
        response = await huge_body_answer(mesh, chunked=chunked)
        await asyncio.sleep(0.5)  # and while the rest drains
        seen = watch.results()
    finally:
        watch.stop()
    assert response.status_code == 413, response.text[:300]
    assert response.json()["error"]["code"] == "request_too_large"
    assert set(seen["statuses"]) == {200}
    assert max(seen["rss"]) < 500, seen["rss"]
    # Responsive: /health answered within 0.1 s nine times in ten, none waited 0.5 s. (On 2 cores,
    # shared by the 100 MB sender, the router and this watch, one probe in ~50 was seen at 0.22 s:
    # a process descheduled, not a blocked event loop, which would hold every probe for the upload.)
    latencies = sorted(seen["latencies"])
    assert len(latencies) >= 5 and latencies[int(0.9 * (len(latencies) - 1))] < 0.1 and latencies[-1] < 0.5, latencies


async def test_four_1_mb_stop_strings_are_a_400(mesh: LocalMesh) -> None:
    body = {**GREEDY, "stop": ["x" * MB] * 4}
    assert len(json.dumps(body)) < 4 * 1024 * 1024  # within the body limit: the stop limit refuses it
    response = await post(mesh.base_url, "/v1/completions", body)
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["param"] == "stop"


TOOL_CHAT = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}


def tool(**function: object) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, **function}}


def called(arguments: str, name: str = "f") -> list[dict]:
    """A history in which the assistant called ``name`` with ``arguments`` and the tool answered."""
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "{LONE}"}}]}}', "messages.0.content"),
        ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "{LONE}"}}', "prompt"),
        ("/v1/completions", f'{{"model": "{LONE}", "prompt": "x"}}', "model"),
        ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "x", "stop": ["{LONE}"]}}', "stop"),
        ("/v1/chat/completions", json.dumps(TOOL_CHAT | {"tools": [tool(description="a\ud800b")]}), "tools.0.function.description"),
        (
            "/v1/chat/completions",
            json.dumps(TOOL_CHAT | {"tools": [tool(parameters={"type": "object", "properties": {"a\ud800b": {"type": "string"}}})]}),
            "tools.0.function.parameters.properties",
        ),
        ("/v1/chat/completions", json.dumps(TOOL_CHAT | {"messages": called('{"a": "b"}', name="f\ud800")}), "messages.1.tool_calls.0.function.name"),
        # JSON in a JSON string: the surrogate appears only once the template reads the arguments
        ("/v1/chat/completions", json.dumps(TOOL_CHAT | {"messages": called('{"a": "\\ud800"}')}), "messages"),
    ],
    ids=["content", "prompt", "model", "stop", "tool-description", "tool-schema-key", "tool-call-name", "tool-call-arguments"],
)
async def test_a_lone_surrogate_is_a_400(mesh: LocalMesh, path: str, body: str, param: str) -> None:
    """Anywhere in the request, never a 500; and the connection stays open for the next request
    (a 500 from the app closed it under the client)."""
    async with httpx.AsyncClient(base_url=mesh.base_url, timeout=30) as client:
        response = await client.post(path, content=body.encode(), headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text[:300]
        assert response.json()["error"]["param"] == param
        assert "lone surrogate U+D800" in response.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 200  # the same connection


async def test_what_a_client_sends_cannot_forge_a_log_line(mesh: LocalMesh) -> None:
    """The router logs a refused request with what the client sent (a model's name, a path);
    line breaks and NUL in it are written as escapes: no forged line, no binary log."""
    forged = "2026-12-06 04:00:00,000 CRITICAL kvmesh.fake [trace=- span=-]: FORGED"
    async with httpx.AsyncClient(base_url=mesh.base_url, timeout=30) as client:
        assert (await client.post("/v1/completions", json={"model": f"y\n{forged}", "prompt": "x"})).status_code == 404
        assert (await client.get("/v1/models/a%00b")).status_code == 404
    log = mesh.workdir / "logs" / "router.log"
    deadline = time.monotonic() + 10
    while "a\\x00b" not in log.read_text(errors="replace") and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    text = log.read_bytes()
    assert b"\x00" not in text
    lines = text.decode().splitlines()
    assert not [line for line in lines if line.startswith(forged[:20])], "a forged line"
    assert any(f"y\\n{forged}" in line for line in lines)


async def test_the_mesh_still_serves(mesh: LocalMesh) -> None:
    response = await post(mesh.base_url, "/v1/completions", GREEDY)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].startswith(" Paris")


async def test_sigterm_ends_a_live_stream_with_an_error_event_and_done(mesh: LocalMesh) -> None:
    """Last in this module: it stops the mesh's router."""
    assert mesh.router is not None
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    datas: list[str] = []
    async with httpx.AsyncClient(base_url=mesh.base_url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    datas.append(line[len("data: ") :])
                    if len(datas) == 5:
                        mesh.router.signal(signal.SIGTERM)
                        started = time.monotonic()
    code = await asyncio.to_thread(mesh.router.popen.wait, 10)
    seconds = time.monotonic() - started
    assert datas[-1] == "[DONE]", datas[-3:]
    assert json.loads(datas[-2])["error"]["code"] == "unavailable", datas[-2]
    assert json.loads(datas[-2])["error"]["message"] == "the server is shutting down"
    assert (code, seconds < 2.5) == (0, True), (code, seconds, mesh.router.tail(30))
