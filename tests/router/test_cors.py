"""CORS: off by default (a preflight is the 405 it always was, no CORS headers), and with allowed
origins a preflight is answered before the API key is asked for, answers to those origins (errors
too) carry their headers, and another origin's preflight is a 400 with an OpenAI body."""

from __future__ import annotations

import httpx
import pytest

from kvmesh.services.router.app import create_app
from kvmesh.settings.router import router_parser
from tests.router.fakes import FakeBackend
from tests.router.test_app import MODEL, error

ORIGIN = "http://localhost:3000"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


def client_for(fake: FakeBackend, **options) -> httpx.AsyncClient:
    app = create_app(fake, **options)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_off_by_default(fake: FakeBackend) -> None:
    async with client_for(fake) as client:
        resp = await client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert (resp.status_code, resp.json()) == (
            405,
            error("Method not allowed (OPTIONS /v1/chat/completions)", code="method_not_allowed"),
        )
        assert "access-control-allow-origin" not in resp.headers
        resp = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN})
        assert resp.status_code == 200
        assert "access-control-allow-origin" not in resp.headers


async def test_allowed_origins(fake: FakeBackend) -> None:
    async with client_for(fake, cors_allow_origins=[ORIGIN], api_key="sk-1") as client:
        pre = await client.options("/v1/chat/completions", headers=PREFLIGHT)  # no key: browsers send none
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == ORIGIN
        assert set(pre.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST", "OPTIONS"}
        assert pre.headers["access-control-allow-headers"] == "authorization, content-type"
        assert pre.headers["access-control-max-age"] == "600"
        ok = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN, "Authorization": "Bearer sk-1"}
        )
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == ORIGIN
        assert ok.headers["access-control-expose-headers"] == "Retry-After"
        refused = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN})
        assert refused.status_code == 401  # readable by the page: it carries the CORS headers too
        assert refused.headers["access-control-allow-origin"] == ORIGIN
        other = await client.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert (other.status_code, other.json()) == (400, error("Disallowed CORS origin", code="cors_refused"))
        assert "access-control-allow-origin" not in other.headers
        plain = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Origin": "http://evil.example", "Authorization": "Bearer sk-1"}
        )
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


async def test_any_origin(fake: FakeBackend) -> None:
    async with client_for(fake, cors_allow_origins=["*"]) as client:
        pre = await client.options("/v1/responses", headers={**PREFLIGHT, "Origin": "http://a.example"})
        assert (pre.status_code, pre.headers["access-control-allow-origin"]) == (200, "*")
        models = await client.get("/v1/models", headers={"Origin": "http://b.example"})
        assert models.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize(
    ("argv", "env", "want"),
    [
        ([], "", ()),
        ([], "http://a.example, http://b.example/", ("http://a.example", "http://b.example")),
        (["--cors-allow-origins", "*"], "http://a.example", ("*",)),
    ],
)
def test_the_routers_flag_and_environment(monkeypatch: pytest.MonkeyPatch, argv: list[str], env: str, want: tuple) -> None:
    monkeypatch.setenv("KVMESH_CORS_ALLOW_ORIGINS", env)
    assert router_parser().parse_args(argv).cors_allow_origins == want
