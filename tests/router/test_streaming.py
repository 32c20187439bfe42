"""Streamed answers: SSE chunk order and shapes, errors mid-stream, and clients that go away."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.requests import ClientDisconnect

from kvmesh.services.router.app import create_app
from tests.router.fakes import Emit, Fail, FakeBackend, Finish, Sleep

MODEL = "tiny-llama"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}


async def sse(client: httpx.AsyncClient, path: str, payload: dict) -> tuple[str, list[Any]]:
    """The response's events in order: parsed JSON objects, and "[DONE]" as a string."""
    async with client.stream("POST", path, json=payload) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = (await resp.aread()).decode()
    assert raw.endswith("\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: ")
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return raw, events


def choices(events: list[Any]) -> list[Any]:
    return [e if e == "[DONE]" else e["choices"] for e in events]


async def test_completion_stream(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = [
        Emit((10,), "Hello"),
        Emit((11,), ""),
        Emit((12,), " world"),
        Finish("length", token_ids=(13,), text="!"),
    ]
    _, events = await sse(client, "/v1/completions", {"model": MODEL, "prompt": "The river", "stream": True})
    request_id = fake.calls[0].request_id
    created = events[0]["created"]
    for event in events[:-1]:
        assert {k: v for k, v in event.items() if k != "choices"} == {
            "id": f"cmpl-{request_id}",
            "object": "text_completion",
            "created": created,
            "model": MODEL,
        }
    assert choices(events) == [
        [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": " world", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "!", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
        "[DONE]",
    ]
    assert fake.cancelled == []


async def test_chat_stream_with_usage(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = [Emit((10,), "Hel"), Emit((11,), "lo"), Finish("stop", num_cached_tokens=8)]
    _, events = await sse(client, "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}})
    request_id = fake.calls[0].request_id
    for event in events[:-1]:
        assert (event["id"], event["object"], event["model"]) == (
            f"chatcmpl-{request_id}",
            "chat.completion.chunk",
            MODEL,
        )
    assert [e if e == "[DONE]" else e["usage"] for e in events] == [
        None,
        None,
        None,
        None,
        {
            "prompt_tokens": 15,
            "completion_tokens": 2,
            "total_tokens": 17,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
        "[DONE]",
    ]
    assert choices(events) == [
        [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        [{"index": 0, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}],
        [],
        "[DONE]",
    ]


async def test_chat_stream_without_usage_has_no_usage_field(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    raw, events = await sse(client, "/v1/chat/completions", CHAT)
    assert len(events) == 4  # role, "Hi", finish, [DONE]
    assert all("usage" not in e for e in events[:-1])
    assert raw.endswith("data: [DONE]\n\n")


async def test_error_mid_stream_is_an_event_then_done(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = [Emit((10,), "Hel"), Fail("unavailable", "decode worker lost")]
    _, events = await sse(client, "/v1/chat/completions", CHAT)
    assert choices(events[:2]) == [
        [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        [{"index": 0, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}],
    ]
    assert events[2:] == [
        {
            "error": {
                "message": "decode worker lost",
                "type": "service_unavailable",
                "param": None,
                "code": "unavailable",
            }
        },
        "[DONE]",
    ]
    assert fake.cancelled == []
    metrics = (await client.get("/metrics")).text
    assert 'kvmesh_router_requests_total{endpoint="/v1/chat/completions",status="503"} 1.0' in metrics
    assert "kvmesh_router_requests_in_flight 0.0" in metrics


# --------------------------------------------------------------------------- clients going away
class Disconnecting:
    """Drives the ASGI app directly: sends one request, then reports ``http.disconnect``.

    ``httpx.ASGITransport`` runs the app to completion before returning a response, so it cannot
    deliver a disconnect mid-stream; this talks ASGI to the app instead, with no network.
    """

    def __init__(self, payload: dict, *, after_chunks: int, spec_version: str, fake: FakeBackend) -> None:
        self.body = json.dumps(payload).encode()
        self.after_chunks = after_chunks
        self.spec_version = spec_version
        self.fake = fake
        self.messages: list[dict] = []
        self._request_sent = False
        self._gone = asyncio.Event()

    def scope(self, path: str) -> dict:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": self.spec_version},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
            "client": ("127.0.0.1", 1),
            "server": ("test", 80),
        }

    async def receive(self) -> dict:
        if not self._request_sent:
            self._request_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        if self.after_chunks == 0:  # non-streamed: leave once the backend produced something
            await self.fake.started.wait()
            self._gone.set()
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if self._gone.is_set() and self.spec_version == "2.4":
            raise OSError("client gone")  # what an ASGI 2.4 server does on a closed connection
        self.messages.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            if (
                sum(1 for m in self.messages if m["type"] == "http.response.body" and m.get("body"))
                >= self.after_chunks
            ):
                self._gone.set()

    async def run(self, app: FastAPI, path: str) -> None:
        await asyncio.wait_for(app(self.scope(path), self.receive, self.send), timeout=10)

    def body_chunks(self) -> list[str]:
        return [
            m["body"].decode() for m in self.messages if m["type"] == "http.response.body" and m.get("body")
        ]


SLOW = [Emit((10,), "Hel"), Emit((11,), "lo"), Sleep(30), Finish("stop")]


@pytest.mark.parametrize("cancel_seconds", [0.0, 0.01])
@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_client_gone_mid_stream_cancels_the_backend_request(
    fake: FakeBackend, spec_version: str, cancel_seconds: float
) -> None:
    fake.script = SLOW
    fake.cancel_seconds = cancel_seconds  # the backend's cleanup awaits, as publishing a cancel would
    app = create_app(fake)
    client = Disconnecting(CHAT, after_chunks=2, spec_version=spec_version, fake=fake)
    if spec_version == "2.4":  # starlette reports the failed send as ClientDisconnect
        with pytest.raises(ClientDisconnect):
            await client.run(app, "/v1/chat/completions")
    else:  # starlette sees http.disconnect and cancels the response
        await client.run(app, "/v1/chat/completions")
    assert fake.cancelled == [fake.calls[0].request_id]
    assert fake.finished == []
    assert client.messages[0]["status"] == 200
    assert client.body_chunks()[1].startswith('data: {"id":"chatcmpl-')
    metrics = app.state.metrics.render().decode()
    assert 'kvmesh_router_requests_total{endpoint="/v1/chat/completions",status="499"} 1.0' in metrics
    assert "kvmesh_router_requests_in_flight 0.0" in metrics


async def test_client_gone_during_non_streamed_request_cancels_it(fake: FakeBackend) -> None:
    fake.script = SLOW
    fake.cancel_seconds = 0.01
    app = create_app(fake)
    client = Disconnecting({"model": MODEL, "prompt": "x"}, after_chunks=0, spec_version="2.3", fake=fake)
    await client.run(app, "/v1/completions")
    assert fake.cancelled == [fake.calls[0].request_id]
    assert client.messages[0]["status"] == 499
    metrics = app.state.metrics.render().decode()
    assert 'kvmesh_router_requests_total{endpoint="/v1/completions",status="499"} 1.0' in metrics
    assert "kvmesh_router_requests_in_flight 0.0" in metrics


async def test_stream_read_to_the_end_is_not_a_cancel(fake: FakeBackend) -> None:
    app = create_app(fake)
    client = Disconnecting(CHAT, after_chunks=100, spec_version="2.3", fake=fake)
    await client.run(app, "/v1/chat/completions")
    assert fake.cancelled == []
    assert client.body_chunks()[-1] == "data: [DONE]\n\n"


@pytest.mark.parametrize("when", ["before the first token", "mid-stream"])
async def test_a_cancel_from_outside_is_not_taken_for_the_client_leaving(fake: FakeBackend, when: str) -> None:
    """The router's disconnect watch cancels the request's own task when the client leaves;
    a cancellation from elsewhere (the server ending the request) must still end that task
    cancelled, not be taken for the client's leaving and swallowed."""
    fake.script = [Sleep(30), Finish("stop")] if when == "before the first token" else SLOW
    app = create_app(fake)
    client = Disconnecting(CHAT, after_chunks=1_000_000, spec_version="2.3", fake=fake)  # never leaves
    task = asyncio.ensure_future(client.run(app, "/v1/chat/completions"))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if fake.calls and (when == "before the first token" or len(client.body_chunks()) >= 2):
            break
    assert not task.done() and fake.calls
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fake.cancelled == [fake.calls[0].request_id]
    assert "kvmesh_router_requests_in_flight 0.0" in app.state.metrics.render().decode()
