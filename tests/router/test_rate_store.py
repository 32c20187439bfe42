"""Rate-limit counters in NATS JetStream KV, against a real nats-server: routers share one
budget, racing updates never over-admit, and a NATS outage falls back to local counting."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import nats
import pytest

from kvmesh.infra.servers import start_nats
from kvmesh.services.router.app import create_app
from kvmesh.services.router.rate_limits import parse_rate_limits
from kvmesh.services.router.rate_store import NatsCounters, bucket_name
from tests.router.fakes import FakeBackend

MODEL = "tiny-llama"
RIVER = {"model": MODEL, "prompt": "The river"}  # 3 prompt tokens
COUNTER = ("input", "alice", 60)
STORE_LOGGER = "kvmesh.services.router.rate_store"


@pytest.fixture
async def nats_server(tmp_path: Path):
    server = await asyncio.to_thread(start_nats, tmp_path)
    yield server
    server.stop()


@pytest.fixture
async def connect(nats_server):
    conns: list[nats.NATS] = []

    async def make() -> nats.NATS:
        conns.append(await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1))
        return conns[-1]

    yield make
    for nc in conns:
        await nc.close()


def test_bucket_name_is_valid_for_any_namespace() -> None:
    assert bucket_name("default") == "kvmesh_default_ratelimits"
    assert bucket_name("team.a/b") == "kvmesh_team_a_b_ratelimits"


async def test_two_routers_share_a_budget_and_races_never_over_admit(connect) -> None:
    a, b = NatsCounters(await connect(), "ns"), NatsCounters(await connect(), "ns")
    results = await asyncio.gather(*[(a if i % 2 else b).add_within(COUNTER, 7, 1, 20) for i in range(30)])
    assert results.count(True) == 20
    assert (await a.read(COUNTER, 7), await b.read(COUNTER, 7)) == (20, 20)
    assert await b.read(COUNTER, 8) == 0  # the next window starts empty
    await a.add(("output", "alice", 60), 7, 5)
    assert await b.read(("output", "alice", 60), 7) == 5
    assert a.fallback.used(COUNTER, 7) == 0  # nothing was counted locally
    kv = await (await connect()).jetstream().key_value("kvmesh_ns_ratelimits")
    assert (await kv.get("input.alice.60s.7")).value == b"20"


async def test_requests_spread_over_two_routers_exceed_the_limit_once(connect, tokenizer) -> None:
    config = parse_rate_limits({"default": {"input_tokens_per_hour": 9}})  # three requests of 3 tokens
    apps = [
        create_app(FakeBackend(tokenizer), rate_limits=config, rate_store=NatsCounters(await connect(), "ns"), shared_rate_store=True)
        for _ in range(2)
    ]
    clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") for app in apps]
    try:
        statuses = [(await clients[i % 2].post("/v1/completions", json=RIVER)).status_code for i in range(5)]
    finally:
        for c in clients:
            await c.aclose()
    assert statuses == [200, 200, 200, 429, 429]


async def test_nats_gone_falls_back_to_local_counting_and_back(nats_server, connect, caplog) -> None:
    now = [0.0]
    counters = NatsCounters(await connect(), "ns", timeout=0.3, retry_after=5.0, clock=lambda: now[0])
    assert await counters.add_within(COUNTER, 1, 3, 10)
    nats_server.stop()
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        assert await asyncio.wait_for(counters.add_within(COUNTER, 1, 3, 10), 2)  # local: 3 of 10
        assert await counters.add_within(COUNTER, 1, 7, 10)  # local: 10
        assert not await counters.add_within(COUNTER, 1, 1, 10)
        warnings = [r.getMessage() for r in caplog.records if r.name == STORE_LOGGER]
        assert len(warnings) == 1 and "counting in this router alone" in warnings[0]
        await asyncio.to_thread(nats_server.respawn)
        nc = counters.nc
        deadline = asyncio.get_running_loop().time() + 10
        while not nc.is_connected:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        assert await counters.read(COUNTER, 1) == 10  # still local: NATS is tried again after retry_after
        now[0] = 6.0
        assert await counters.read(COUNTER, 1) == 3  # the shared count, kept by JetStream's file store
        assert "answers again" in [r.getMessage() for r in caplog.records if r.name == STORE_LOGGER][-1]


async def test_connect_reports_whether_the_bucket_answers(nats_server, connect) -> None:
    # 3 s: JetStream makes the bucket on the first call, which a loaded machine took past 0.3 s
    counters = NatsCounters(await connect(), "ns", timeout=3)
    assert await counters.connect()
    nats_server.stop()
    assert not await asyncio.wait_for(counters.connect(), 10)


class Disconnected:
    is_connected = False  # a NATS connection that is reconnecting


async def test_requests_are_served_and_limited_while_nats_is_away(tokenizer, caplog) -> None:
    config = parse_rate_limits({"default": {"input_tokens_per_hour": 6}})
    app = create_app(FakeBackend(tokenizer), rate_limits=config, rate_store=NatsCounters(Disconnected(), "ns"), shared_rate_store=True)
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            statuses = [(await client.post("/v1/completions", json=RIVER)).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]  # counted in this router alone
    warnings = [r.getMessage() for r in caplog.records if r.name == STORE_LOGGER]
    assert warnings == [
        "rate limits: the NATS KV bucket kvmesh_ns_ratelimits did not answer (not connected to NATS); "
        "counting in this router alone until it does"
    ]
