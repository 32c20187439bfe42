"""The fast lane (``fast_lane``): the generation endpoints' valid JSON requests are served
without FastAPI's request handling, and answered exactly as FastAPI's route answers them;
everything else still goes through FastAPI."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.requests import Request

from kvmesh.services.router.app import create_app
from tests.router.fakes import Emit, FakeBackend, Finish

MODEL = "tiny-llama"
COMPLETION = {"model": MODEL, "prompt": "The river", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def without_lane(app: FastAPI) -> FastAPI:
    """``app`` with its lanes emptied: every request through FastAPI's route."""
    for middleware in app.user_middleware:
        if "lanes" in middleware.kwargs:
            middleware.kwargs["lanes"].clear()
            return app
    raise AssertionError("the app has no fast lane")


@pytest.fixture
def routed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths whose body FastAPI's request handling read (the lane reads none itself)."""
    paths: list[str] = []
    body = Request.body

    async def counted(self: Request) -> bytes:
        paths.append(self.url.path)
        return await body(self)

    monkeypatch.setattr(Request, "body", counted)
    return paths


async def answer(app: FastAPI, path: str, content: bytes, content_type: str = "application/json") -> tuple[int, dict[str, str], str]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        resp = await client.post(path, content=content, headers={"content-type": content_type})
    # a request's own id and time differ between two requests
    text = re.sub(r'"(chatcmpl-|cmpl-)?[0-9a-f]{32}"', '"ID"', resp.text)
    text = re.sub(r'"created":\s*\d+', '"created":0', text)
    headers = {k: v for k, v in resp.headers.items() if k != "content-length"}
    return resp.status_code, headers, text


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/v1/completions", COMPLETION),
        ("/v1/completions", {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", CHAT),
        ("/v1/chat/completions", {**CHAT, "stream": True, "logprobs": True, "top_logprobs": 2}),
    ],
    ids=["completion", "completion-stream", "chat", "chat-stream-logprobs"],
)
async def test_a_valid_request_takes_the_lane_and_gets_fastapis_answer(
    fake: FakeBackend, routed: list[str], path: str, payload: dict[str, Any]
) -> None:
    fake.script = [Emit((10,), "Hel"), Emit((11,), "lo"), Finish("length", token_ids=(12,), text="!")]
    content = json.dumps(payload).encode()
    lane = await answer(create_app(fake), path, content)
    assert routed == []  # FastAPI never handled it
    fastapi_answer = await answer(without_lane(create_app(fake)), path, content)
    assert set(routed) == {path}
    assert lane == fastapi_answer
    assert lane[0] == 200 and "Hel" in lane[2]
    assert fake.calls[0].sampling == fake.calls[1].sampling
    assert fake.calls[0].prompt_token_ids == fake.calls[1].prompt_token_ids


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (json.dumps({**COMPLETION, "max_tokens": "lots"}).encode(), "application/json"),  # a bad field
        (json.dumps({**COMPLETION, "best_of_all": 2}).encode(), "application/json"),  # an unknown one
        (b'{"model": "tiny-llama", "prompt": ', "application/json"),  # not JSON
        (json.dumps(COMPLETION).encode(), "text/plain"),  # not declared JSON
        (b"", "application/json"),  # no body
    ],
    ids=["bad-field", "unknown-field", "bad-json", "text-plain", "empty"],
)
async def test_what_the_lane_does_not_take_goes_to_fastapi(fake: FakeBackend, routed: list[str], content: bytes, content_type: str) -> None:
    status, _, text = await answer(create_app(fake), "/v1/completions", content, content_type)
    assert set(routed) == {"/v1/completions"}  # the body was replayed to FastAPI's route
    assert (status, text) == (await answer(without_lane(create_app(fake)), "/v1/completions", content, content_type))[::2]
    assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error"
    assert fake.calls == []


async def test_the_lanes_refusals_are_the_apps(fake: FakeBackend, routed: list[str]) -> None:
    """An ``APIError`` from the handler (an unknown model) or from a validator (``ignore_eos``
    with a grammar) is answered, and counted, as the app's exception handler does."""
    app = create_app(fake)
    status, _, text = await answer(app, "/v1/completions", json.dumps({**COMPLETION, "model": "gpt-7"}).encode())
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
    grammar = {**CHAT, "ignore_eos": True, "response_format": {"type": "json_object"}}
    status, _, text = await answer(app, "/v1/chat/completions", json.dumps(grammar).encode())
    assert status == 400 and json.loads(text)["error"]["param"] == "ignore_eos"
    assert routed == [] and fake.calls == []
    metrics = app.state.metrics.render().decode()
    assert 'kvmesh_router_requests_total{endpoint="/v1/completions",status="404"} 1.0' in metrics
    assert 'kvmesh_router_requests_total{endpoint="/v1/chat/completions",status="400"} 1.0' in metrics
