"""API keys and rate limits through real processes: no key in any process's argv, a limit that
trips and recovers, and two routers that share one budget through NATS JetStream KV."""

from __future__ import annotations

import asyncio
import json
import re
import stat
import time
from pathlib import Path

import httpx
import pytest

from kvmesh.infra.local_mesh import ROUTER_READY, LocalMesh, MeshOptions

MODEL = "SmolLM2-135M-Instruct"
SHARED_KEY = "sk-shared-5b1e0c4f9a7d"
QUICK_KEY = "sk-quick-08c2d6e1f3b4"
PROMPT_IDS = [504, 3458, 282, 4649]  # 4 prompt tokens, whatever they say
BODY = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
LIMITS = {
    "keys": {
        "shared": {"input_tokens_per_hour": 3 * len(PROMPT_IDS)},  # three requests an hour, for all routers
        "quick": {"output_tokens_per_second": 2},  # one request a second
    }
}


def test_a_key_given_to_mesh_options_goes_to_a_private_file(tmp_path: Path) -> None:
    mesh = LocalMesh(MeshOptions(api_key="sk-opt-1"), tmp_path)
    path = Path(mesh._api_key_file())
    assert path.parent == tmp_path
    assert path.read_text() == "default:sk-opt-1\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_kvmesh_up_checks_the_key_file_before_starting(tmp_path: Path) -> None:
    from kvmesh.infra.up import UpUsageError, check_api_key_file

    with pytest.raises(UpUsageError, match="cannot read the API key file"):
        check_api_key_file(str(tmp_path / "absent"))
    (tmp_path / "empty").write_text("# nothing yet\n")
    with pytest.raises(UpUsageError, match="holds no key"):
        check_api_key_file(str(tmp_path / "empty"))
    (tmp_path / "keys").write_text("a:sk-a\n")
    check_api_key_file(str(tmp_path / "keys"))


@pytest.mark.slow
async def test_kvmesh_up_passes_the_key_file_and_the_environment_not_the_key(
    tmp_path: Path, default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.mesh.test_up import start_up

    (tmp_path / "keys").write_text(f"quick:{QUICK_KEY}\n")
    monkeypatch.setenv("KVMESH_API_KEY", SHARED_KEY)  # one more key, named default, by the environment
    monkeypatch.chdir(tmp_path)
    up = start_up(tmp_path / "work", default_model_dir, "--prefill", "0", "--api-key-file", "keys")
    try:
        info = up.read_pids()
        for pid in [info["pid"], *info["processes"].values()]:
            assert SHARED_KEY not in cmdline(pid) and QUICK_KEY not in cmdline(pid)
        assert f"--api-key-file {tmp_path / 'keys'} " in cmdline(info["processes"]["router"])
        async with httpx.AsyncClient(base_url=up.base_url, timeout=60) as client:
            assert (await client.post("/v1/completions", json=BODY)).status_code == 401
            for key in (QUICK_KEY, SHARED_KEY):
                assert (await client.post("/v1/completions", json=BODY, headers=bearer(key))).status_code == 200
        assert up.stop()[0] == 0
    finally:
        up.cleanup()


def mesh_options(**fields: object) -> MeshOptions:
    """With the mesh's NATS users on (the default): the routers' user may use JetStream for
    the rate-limit bucket and nothing else (kvmesh.security.nats_permissions)."""
    return MeshOptions(**fields)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path):
    workdir = tmp_path_factory.mktemp("keys-mesh")
    key_file = workdir / "keys"
    key_file.write_text(f"# a mounted Secret\nshared:{SHARED_KEY}\nquick:{QUICK_KEY}\n")
    key_file.chmod(0o600)
    limits = workdir / "limits.json"
    limits.write_text(json.dumps(LIMITS))
    options = mesh_options(
        prefill=0,
        decode=1,
        kv_cache_mib=32,
        num_threads=1,
        request_timeout=20,
        api_key_file=str(key_file),
        env={
            "KVMESH_CACHE_DIR": str(default_model_dir.parent.parent),
            "KVMESH_RATE_LIMITS": str(limits),
            "KVMESH_RATE_LIMIT_STORE": "nats",
        },
    )
    mesh = LocalMesh(options, workdir)
    mesh.start()
    try:
        yield mesh
    finally:
        mesh.stop()


def second_router(mesh: LocalMesh):
    """One more router process against the same NATS and etcd, on a port of its own."""
    router = mesh._spawn("router-2", mesh._router_argv(0))
    line = router.wait_for_line(lambda text: ROUTER_READY.search(text) is not None, 120)
    match = ROUTER_READY.search(line)
    assert match is not None
    return router, match.group(1)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def rejections(metrics: str, key: str) -> float:
    match = re.search(rf'^kvmesh_router_rate_limit_rejections_total{{key="{key}",limit="input_tokens"}} (\S+)$', metrics, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.mark.slow
async def test_no_key_in_any_argv_and_requests_need_one(mesh: LocalMesh) -> None:
    pids = json.loads(mesh.pids_path.read_text())["processes"]
    assert {"nats-server", "etcd", "router", "decode-1"} <= set(pids)
    for name, pid in pids.items():
        line = cmdline(pid)
        assert SHARED_KEY not in line and QUICK_KEY not in line, name
    assert "--api-key-file" in cmdline(pids["router"]) and "--api-key " not in cmdline(pids["router"])
    async with httpx.AsyncClient(base_url=mesh.base_url, timeout=60) as client:
        resp = await client.post("/v1/completions", json=BODY)
        assert (resp.status_code, resp.json()["error"]["code"]) == (401, "invalid_api_key")
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/v1/models", headers=bearer(QUICK_KEY))).status_code == 200


@pytest.mark.slow
async def test_a_limit_trips_and_recovers(mesh: LocalMesh) -> None:
    async with httpx.AsyncClient(base_url=mesh.base_url, timeout=60, headers=bearer(QUICK_KEY)) as client:
        refused = None
        for _ in range(10):  # 2 output tokens each: the next request in the same second is refused
            resp = await client.post("/v1/completions", json=BODY)
            if resp.status_code == 429:
                refused = resp
                break
            assert resp.status_code == 200, resp.text
        assert refused is not None, "never rate limited"
        error = refused.json()["error"]
        assert (error["code"], error["type"]) == ("rate_limit_exceeded", "tokens")
        assert refused.headers["retry-after"] == "1"
        await asyncio.sleep(int(refused.headers["retry-after"]))
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 2


@pytest.mark.slow
async def test_two_routers_share_one_budget(mesh: LocalMesh) -> None:
    into_hour = time.time() % 3600
    if into_hour > 3540:  # the hour's budget would reset mid-test
        await asyncio.sleep(3601 - into_hour)
    router, url = second_router(mesh)
    try:
        assert ROUTER_READY.search(router.tail(200))
        assert SHARED_KEY not in cmdline(router.pid)
        urls = [mesh.base_url, url]
        statuses = []
        async with httpx.AsyncClient(timeout=60, headers=bearer(SHARED_KEY)) as client:
            for i in range(6):  # three of 4 tokens fit an hour's 12; spread over both routers
                resp = await client.post(f"{urls[i % 2]}/v1/completions", json=BODY)
                statuses.append(resp.status_code)
                if resp.status_code == 429:
                    assert int(resp.headers["retry-after"]) >= 1
                    assert resp.json()["error"]["code"] == "rate_limit_exceeded"
            assert statuses == [200, 200, 200, 429, 429, 429]
            counts = [rejections((await client.get(f"{u}/metrics")).text, "shared") for u in urls]
        assert counts == [1.0, 2.0]  # the 5th on the first router, the 4th and 6th on the second
        for process in (mesh.router, router):
            assert "did not answer" not in process.tail(500)  # counted in NATS, not locally
    finally:
        router.stop()
    assert not router.is_running()
