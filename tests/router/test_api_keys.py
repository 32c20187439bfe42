"""Named API keys: the key file and KVMESH_API_KEY, never argv; what is behind auth and what is not."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from kvmesh.services.router.api_keys import ApiKeyError, ApiKeys, load_api_keys, parse_key_file
from kvmesh.services.router.app import create_app
from kvmesh.settings.router import NO_KEY_IN_ARGV, access_from, router_parser
from tests.router.fakes import FakeBackend

MODEL = "tiny-llama"
PAYLOAD = {"model": MODEL, "prompt": "The river"}
KEY_FILE = """\
# the router's keys
alice: sk-alice-111
bob:sk-bob-222

"""


def error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


MISSING = error("Missing API key: use 'Authorization: Bearer <key>'.")
WRONG = error("Incorrect API key provided.")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --------------------------------------------------------------------------- the key file
def test_key_file_lines_name_their_keys_and_a_bare_key_is_default() -> None:
    assert parse_key_file(KEY_FILE) == {"alice": "sk-alice-111", "bob": "sk-bob-222"}
    assert parse_key_file("sk-only\n") == {"default": "sk-only"}
    assert parse_key_file("  # nothing\n\n") == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("al ice:k\n", "line 1: bad key name"),
        ("a:\n", "line 1: the key named 'a' is empty"),
        ("a:1\n#\na:2\n", "line 3: the name 'a' is given twice"),
        ("k1\nk2\n", "line 2: the name 'default' is given twice"),
    ],
)
def test_bad_key_files_are_refused_with_the_line(text: str, message: str) -> None:
    with pytest.raises(ApiKeyError, match=re.escape(message)):
        parse_key_file(text)


def test_two_names_with_one_key_are_refused() -> None:
    with pytest.raises(ApiKeyError, match="same key"):
        ApiKeys({"a": "k", "b": "k"})


def test_identify_names_the_key() -> None:
    keys = ApiKeys({"alice": "sk-alice-111", "bob": "sk-bob-222"})
    assert keys.identify(b"sk-bob-222") == "bob"
    assert keys.identify(b"sk-bob-22") is None
    assert keys.identify(b"") is None


def test_keys_from_the_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(KEY_FILE)
    keys = load_api_keys(str(path), env={"KVMESH_API_KEY": "sk-env"})
    assert keys is not None and keys.names == ["alice", "bob", "default"]
    assert keys.identify(b"sk-env") == "default"
    assert load_api_keys(None, env={}) is None
    with pytest.raises(ApiKeyError, match="cannot read the API key file"):
        load_api_keys(str(tmp_path / "absent"), env={})
    path.write_text("sk-file\n")
    with pytest.raises(ApiKeyError, match="both give the key named 'default'"):
        load_api_keys(str(path), env={"KVMESH_API_KEY": "sk-env"})


# --------------------------------------------------------------------------- the router's flags
def test_router_reads_the_key_file_and_key_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "keys"
    path.write_text(KEY_FILE)
    monkeypatch.setenv("KVMESH_API_KEY_FILE", str(path))
    monkeypatch.setenv("KVMESH_API_KEY", "sk-env")
    monkeypatch.setenv("KVMESH_AUTH_METRICS", "1")
    parser = router_parser()
    args = parser.parse_args([])
    keys, rate_limits = access_from(args, parser)
    assert keys is not None and keys.names == ["alice", "bob", "default"]
    assert (args.auth_metrics, args.auth_docs, rate_limits) == (True, False, None)


@pytest.mark.parametrize("argv", [["--api-key", "sk-x"], ["--api-key=sk-x"], ["--api-key"]])
def test_router_refuses_a_key_in_argv(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        router_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"kvmesh-router: error: {NO_KEY_IN_ARGV}\n"
    assert "use --api-key-file PATH or KVMESH_API_KEY" in NO_KEY_IN_ARGV


def test_kvmesh_up_refuses_a_key_in_argv(capsys: pytest.CaptureFixture[str]) -> None:
    from kvmesh.cli import build_parser as cli_parser

    with pytest.raises(SystemExit) as exit_:
        cli_parser().parse_args(["up", "--api-key", "sk-x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "use --api-key-file PATH or the environment variable KVMESH_API_KEY" in err
    assert cli_parser().parse_args(["up", "--api-key-file", "/k"]).api_key_file == "/k"


def test_auth_on_metrics_without_keys_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVMESH_API_KEY", raising=False)
    parser = router_parser()
    with pytest.raises(SystemExit):
        access_from(parser.parse_args(["--auth-docs"]), parser)


# --------------------------------------------------------------------------- over HTTP
def keyed_app(fake: FakeBackend, **options: bool):
    return create_app(fake, api_keys=ApiKeys({"alice": "sk-alice-111", "bob": "sk-bob-222"}), **options)


async def test_named_keys_admit_and_wrong_or_missing_keys_get_401(
    fake: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    app = keyed_app(fake)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        resp = await client.post("/v1/completions", json=PAYLOAD)
        assert (resp.status_code, resp.json()) == (401, MISSING)
        for header in (bearer("sk-carol"), bearer("sk-alice-11"), {"Authorization": "sk-alice-111"}):
            resp = await client.post("/v1/completions", json=PAYLOAD, headers=header)
            assert (resp.status_code, resp.json()) == (401, WRONG)
        assert (await client.get("/v1/models")).status_code == 401
        with caplog.at_level("INFO", logger="kvmesh.services.router.metrics"):
            assert (await client.post("/v1/completions", json=PAYLOAD, headers=bearer("sk-alice-111"))).status_code == 200
            assert (await client.post("/v1/completions", json=PAYLOAD, headers=bearer("sk-bob-222"))).status_code == 200
        assert (await client.get("/v1/models", headers=bearer("sk-bob-222"))).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert len(fake.calls) == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "kvmesh.services.router.metrics"]
    assert [re.search(r" key=(\S+) ", line).group(1) for line in lines] == ["alice", "bob"]  # type: ignore[union-attr]
    assert 'kvmesh_router_requests_total{endpoint="/v1/completions",status="401"} 4.0' in metrics
    assert 'kvmesh_router_key_requests_total{key="alice",status="200"} 1.0' in metrics
    assert 'kvmesh_router_key_prompt_tokens_total{key="bob"} 3.0' in metrics
    assert "sk-" not in metrics and not any("sk-" in line for line in lines)


async def test_metrics_and_docs_are_open_unless_asked(fake: FakeBackend) -> None:
    app = keyed_app(fake)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):
            assert (await client.get(path)).status_code == 200, path


@pytest.mark.parametrize(
    ("options", "closed"),
    [
        ({"auth_metrics": True}, {"/metrics"}),
        ({"auth_docs": True}, {"/docs", "/redoc", "/openapi.json"}),
        ({"auth_metrics": True, "auth_docs": True}, {"/metrics", "/docs", "/redoc", "/openapi.json"}),
    ],
)
async def test_metrics_and_docs_behind_auth_when_asked(fake: FakeBackend, options: dict, closed: set[str]) -> None:
    app = keyed_app(fake, **options)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):
            resp = await client.get(path)
            if path in closed:
                assert (resp.status_code, resp.json()) == (401, MISSING), path
                assert (await client.get(path, headers=bearer("sk-bob-222"))).status_code == 200, path
            else:
                assert resp.status_code == 200, path
        for path in ("/health", "/health/ready", "/health/live"):
            assert (await client.get(path)).status_code == 200, path


def test_auth_on_metrics_needs_keys(fake: FakeBackend) -> None:
    with pytest.raises(ValueError, match="needs API keys"):
        create_app(fake, auth_metrics=True)
