"""Per-key rate limits over HTTP, on a clock the test moves: each limit trips with a 429 and
Retry-After, recovers with the next window, charges nothing when it refuses, and a concurrency
slot comes back when a stream ends or its client leaves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kvmesh.protocol import SamplingSpec, TokenEvent
from kvmesh.services.router.api_keys import ApiKeys
from kvmesh.services.router.app import create_app
from kvmesh.services.router.limits import Limits
from kvmesh.services.router.rate_limits import (
    KeyLimits,
    RateLimitConfigError,
    TokenRate,
    load_rate_limits,
    parse_rate_limits,
)
from tests.router.fakes import Emit, FakeBackend, Finish
from tests.router.served import served

MODEL = "tiny-llama"
RIVER = {"model": MODEL, "prompt": "The river"}  # 3 prompt tokens
T0 = 1_800_000_000.0  # a whole minute: 30_000_000 * 60
KEYS = ApiKeys({"alice": "sk-alice", "bob": "sk-bob"})


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def rate_limited(message: str, type_: str = "tokens") -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": "rate_limit_exceeded"}}


def rejections(text: str, key: str, limit: str) -> float:
    prefix = f'kvmesh_router_rate_limit_rejections_total{{key="{key}",limit="{limit}"}} '
    return next((float(line.removeprefix(prefix)) for line in text.splitlines() if line.startswith(prefix)), 0.0)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def limited_app(fake: FakeBackend, clock: Clock, config: dict, *, keys: ApiKeys | None = KEYS):
    return create_app(fake, api_keys=keys, rate_limits=parse_rate_limits(config), clock=clock)


@pytest.fixture
async def make_client():
    clients: list[httpx.AsyncClient] = []

    def make(app) -> httpx.AsyncClient:
        clients.append(httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test"))
        return clients[-1]

    yield make
    for c in clients:
        await c.aclose()


# --------------------------------------------------------------------------- the limits file
def test_limits_file_json_and_yaml(tmp_path: Path) -> None:
    raw = {
        "keys": {"alice": {"input_tokens_per_minute": 100, "output_tokens_per_hour": 50, "max_concurrent": 2}},
        "default": {"output_tokens_per_second": 7},
    }
    (tmp_path / "l.json").write_text(json.dumps(raw))
    (tmp_path / "l.yaml").write_text(
        "keys:\n  alice: {input_tokens_per_minute: 100, output_tokens_per_hour: 50, max_concurrent: 2}\n"
        "default:\n  output_tokens_per_second: 7\n"
    )
    for name in ("l.json", "l.yaml"):
        config = load_rate_limits(str(tmp_path / name))
        assert config.for_key("alice") == KeyLimits(TokenRate(100, 60), TokenRate(50, 3600), 2)
        assert config.for_key("anonymous") == KeyLimits(output=TokenRate(7, 1))
    assert parse_rate_limits({"keys": {"a": {"max_concurrent": 1}}}).for_key("b") is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"keys": {"a": {"input_tokens_per_week": 1}}}, "unknown limit 'input_tokens_per_week'"),
        ({"keys": {"a": {"input_tokens_per_minute": 0}}}, "keys.a.input_tokens_per_minute must be a positive integer"),
        ({"default": {"input_tokens_per_minute": 1, "input_tokens_per_hour": 1}}, "two input token limits"),
        ({"limits": {}}, "unknown field(s) limits"),
        ([], "must be a mapping"),
    ],
)
def test_bad_limits_are_refused(raw: object, message: str) -> None:
    with pytest.raises(RateLimitConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_rate_limits(raw)


# --------------------------------------------------------------------------- token budgets
async def test_input_tokens_trip_and_recover_next_window(fake: FakeBackend, clock: Clock, make_client) -> None:
    app = limited_app(fake, clock, {"keys": {"alice": {"input_tokens_per_minute": 7}}})
    client = make_client(app)
    alice = bearer("sk-alice")
    assert (await client.post("/v1/completions", json=RIVER, headers=alice)).status_code == 200  # 3
    assert (await client.post("/v1/completions", json=RIVER, headers=alice)).status_code == 200  # 6
    clock.now = T0 + 45.2
    resp = await client.post("/v1/completions", json=RIVER, headers=alice)  # 9 > 7
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "15"  # until the minute ends
    assert resp.json() == rate_limited(
        "Rate limit reached for key 'alice' on input tokens per minute: limit 7, used 6, requested 3. "
        "Please try again in 15s."
    )
    # refused at no cost: a 1-token prompt still fits exactly
    assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": [5]}, headers=alice)).status_code == 200
    assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": [5]}, headers=alice)).status_code == 429
    assert (await client.post("/v1/completions", json=RIVER, headers=bearer("sk-bob"))).status_code == 200  # unlimited
    assert len(fake.calls) == 4
    metrics = (await client.get("/metrics")).text
    assert rejections(metrics, "alice", "input_tokens") == 2.0
    assert 'kvmesh_router_requests_total{endpoint="/v1/completions",status="429"} 2.0' in metrics
    clock.now = T0 + 60.0  # the next minute
    assert (await client.post("/v1/completions", json=RIVER, headers=alice)).status_code == 200


async def test_a_prompt_larger_than_the_budget_is_refused_without_retry_after(
    fake: FakeBackend, clock: Clock, make_client
) -> None:
    client = make_client(limited_app(fake, clock, {"default": {"input_tokens_per_minute": 2}}, keys=None))
    resp = await client.post("/v1/completions", json=RIVER)
    assert resp.status_code == 429
    assert "retry-after" not in resp.headers
    assert resp.json()["error"]["message"].startswith("Request too large for key 'anonymous'")


async def test_output_tokens_trip_and_recover(fake: FakeBackend, clock: Clock, make_client) -> None:
    fake.script = [Emit((10, 11), "ab"), Emit((12,), "c"), Finish("length", token_ids=(13,), text="d")]
    client = make_client(limited_app(fake, clock, {"keys": {"bob": {"output_tokens_per_hour": 5}}}))
    bob = bearer("sk-bob")
    resp = await client.post("/v1/completions", json=RIVER, headers=bob)
    assert (resp.status_code, resp.json()["usage"]["completion_tokens"]) == (200, 4)
    stream = {**RIVER, "stream": True}
    resp = await client.post("/v1/completions", json=stream, headers=bob)  # 4 < 5: admitted, never cut
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    clock.now = T0 + 3599.5
    resp = await client.post("/v1/completions", json=RIVER, headers=bob)  # 8 >= 5
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "1"  # rounded up
    assert resp.json() == rate_limited(
        "Rate limit reached for key 'bob' on output tokens per hour: limit 5, used 8. Please try again in 1s."
    )
    assert rejections((await client.get("/metrics")).text, "bob", "output_tokens") == 1.0
    clock.now = T0 + 3600.0
    assert (await client.post("/v1/completions", json=RIVER, headers=bob)).status_code == 200
    assert len(fake.calls) == 3


async def test_anonymous_callers_get_the_default_limits(fake: FakeBackend, clock: Clock, make_client) -> None:
    client = make_client(limited_app(fake, clock, {"default": {"input_tokens_per_second": 3}}, keys=None))
    assert (await client.post("/v1/completions", json=RIVER)).status_code == 200
    resp = await client.post("/v1/completions", json=RIVER)
    assert (resp.status_code, resp.headers["retry-after"]) == (429, "1")
    assert rejections((await client.get("/metrics")).text, "anonymous", "input_tokens") == 1.0
    clock.now += 1
    assert (await client.post("/v1/completions", json=RIVER)).status_code == 200


# --------------------------------------------------------------------------- concurrency
@dataclass
class GatedBackend(FakeBackend):
    """Every request's stream stops after its first event until ``gate`` is set."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *, session_id: str | None = None
    ) -> AsyncIterator[TokenEvent]:
        return self._gated(super().generate(request_id, prompt_token_ids, sampling, session_id=session_id))

    async def _gated(self, events: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
        try:
            yield await anext(events)
            await self.gate.wait()
            async for event in events:
                yield event
        finally:
            await events.aclose()  # type: ignore[attr-defined]


async def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("ending", ["stream ends", "client leaves"])
async def test_concurrency_slot_comes_back_when_a_stream_ends(tokenizer, clock: Clock, ending: str) -> None:
    fake = GatedBackend(tokenizer, script=[Emit((10,), "a"), Emit((11,), "b"), Finish("stop")])
    app = limited_app(fake, clock, {"keys": {"alice": {"max_concurrent": 1}}})
    limiter = app.state.rate_limiter
    alice = bearer("sk-alice")
    async with served(app, Limits()) as server, httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        async with client.stream("POST", "/v1/completions", json={**RIVER, "stream": True}, headers=alice) as first:
            assert first.status_code == 200
            chunks = first.aiter_text()
            assert (await anext(chunks)).startswith("data: ")
            assert limiter.active("alice") == 1
            resp = await client.post("/v1/completions", json=RIVER, headers=alice)
            assert resp.status_code == 429
            assert resp.headers["retry-after"] == "1"
            assert resp.json() == rate_limited(
                "Rate limit reached for key 'alice' on concurrent requests: limit 1. "
                "Please try again when one has finished.",
                type_="requests",
            )
            if ending == "stream ends":
                fake.gate.set()
                rest = "".join([chunk async for chunk in chunks])
                assert rest.endswith("data: [DONE]\n\n")
        # leaving the block closes the connection: the router sees the client go
        await wait_until(lambda: limiter.active("alice") == 0)
        if ending == "client leaves":
            await wait_until(lambda: len(fake.cancelled) == 1)
        fake.gate.set()
        resp = await client.post("/v1/completions", json=RIVER, headers=alice)
        assert resp.status_code == 200
        metrics = (await client.get("/metrics")).text
        assert rejections(metrics, "alice", "concurrent") == 1.0
