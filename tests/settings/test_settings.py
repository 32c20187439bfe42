"""Each service's settings from flags and ``KVMESH_*`` variables (a flag beats its variable;
a bad value is one CLI error line), the registry of every variable, and the start-up every
service shares."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import re
import signal
import tokenize
from pathlib import Path

import pytest

from kvmesh.routing.scorer import ScorerConfigError, read_scorer_config
from kvmesh.settings.values import ValueTextError, host_address

from kvmesh.machine import default_dtype
from kvmesh.service_main import settings_values, start_service, until_signalled
from kvmesh.settings import env
from kvmesh.settings.kv_metadata import kv_metadata_parser, kv_metadata_settings
from kvmesh.settings.router import router_parser, router_settings
from kvmesh.settings.worker import EngineSettings, worker_parser, worker_settings

ROOT = Path(__file__).resolve().parents[2]
MESH = ["--nats-url", "nats://127.0.0.1:1", "--etcd", "127.0.0.1:2"]  # parsed only, never dialled
NAME = re.compile(r"\bKVMESH_[A-Z0-9_]*[A-Z0-9]\b")


@pytest.fixture(autouse=True)
def no_kvmesh_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees only the variables it sets."""
    for name in list(os.environ):
        if name.startswith("KVMESH_"):
            monkeypatch.delenv(name)


def last_error(capsys: pytest.CaptureFixture[str]) -> str:
    """The one line a bad setting prints (no usage block before it), less its help pointer."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return re.sub(r" \(see \S+ --help\)$", "", lines[0])


# -- the registry -------------------------------------------------------------------------------
def code_files() -> list[Path]:
    return sorted([*(ROOT / "shared/kvmesh").rglob("*.py"), *(ROOT / "services").rglob("*.py")])


def string_literals(path: Path) -> list[str]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [t.string for t in tokens if t.type == tokenize.STRING]


def test_every_kvmesh_variable_in_the_code_is_registered() -> None:
    """A ``KVMESH_*`` name in any string of the services' code (a read, a help text, an
    error message) is one the registry holds: a new variable cannot bypass the home, and
    a help text cannot name a variable nothing reads. Nor may code build a name from a
    suffix, which no grep would find."""
    seen: dict[str, list[str]] = {}
    for path in code_files():
        home = path == ROOT / "shared/kvmesh/settings/env.py"
        for literal in string_literals(path):
            assert home or not re.search(r"KVMESH_(\{|%|\"|')", literal), f"{path}: a KVMESH_ name built from parts: {literal}"
            for name in NAME.findall(literal):
                seen.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert len(seen) > 60
    unregistered = {name: where for name, where in seen.items() if name not in env.REGISTRY}
    assert unregistered == {}
    # The test itself sees what it must: names read outside the settings, in help texts.
    assert {"KVMESH_CACHE_DIR", "KVMESH_VLLM_PYTHON", "KVMESH_BIND_GUARD_EXEC", "KVMESH_API_KEY"} <= set(seen)
    assert NAME.findall("x = 'KVMESH_NEW_THING'; help='(KVMESH_OTHER)'") == ["KVMESH_NEW_THING", "KVMESH_OTHER"]


def test_every_kvmesh_variable_the_docs_name_is_registered() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {name: path.name for path in docs for name in NAME.findall(path.read_text())}
    assert len(named) > 20
    assert {name: where for name, where in named.items() if name not in env.REGISTRY} == {}


def test_every_registered_variable_is_read_somewhere() -> None:
    """No entry outlives what read it: each is used through the registry (``env.NAME``)
    or named in the code beside it."""
    texts = {path: path.read_text() for path in code_files() if path != ROOT / "shared/kvmesh/settings/env.py"}
    attributes = {attr: var for attr, var in vars(env).items() if isinstance(var, env.EnvVar)}
    assert {var.name for var in attributes.values()} == set(env.REGISTRY)
    unused = [
        var.name for attr, var in attributes.items()
        if not any(f"env.{attr}" in text or var.name in text for text in texts.values())
    ]  # fmt: skip
    assert unused == []


def test_the_registry_says_which_service_reads_what() -> None:
    """Every variable behind a service's flag lists that service as its reader."""
    parsers = {
        "router": router_parser(),
        "prefill-worker": worker_parser("prefill"),
        "decode-worker": worker_parser("decode"),
        "kv-metadata": kv_metadata_parser(),
    }
    for service, parser in parsers.items():
        variables = {option.env for option in parser._env_options if option.env is not None}
        assert len(variables) > 10, service
        assert [v.name for v in variables if service not in v.readers] == [], service
        assert set(env.variables(service)) >= variables
    assert all(v.name.startswith("KVMESH_") and v.help for v in env.variables())
    assert [v.name for v in env.variables() if v.internal] == ["KVMESH_BIND_GUARD_EXEC", "KVMESH_TRANSFER_BIND", "KVMESH_TRANSFER_BIND_PORTS"]


def test_a_variable_is_read_with_its_type() -> None:
    assert env.KV_CACHE_MIB.read(int, 512, {}) == 512
    assert env.KV_CACHE_MIB.read(int, 512, {"KVMESH_KV_CACHE_MIB": "64"}) == 64
    with pytest.raises(env.EnvError, match=r"^KVMESH_KV_CACHE_MIB='lots': must be an integer, got 'lots'$"):
        env.KV_CACHE_MIB.read(int, 512, {"KVMESH_KV_CACHE_MIB": "lots"})


# -- workers ------------------------------------------------------------------------------------
def test_worker_settings_from_flags() -> None:
    s = worker_settings(
        "prefill",
        [*MESH, "--worker-id", "w1", "--max-num-seqs", "8", "--kv-cache-mib", "32", "--no-prefix-caching",
         "--engine-args", '{"enforce_eager": true}', "--transfer-ports", "20000-20001", "--health-port", "9001",
         "--namespace", "ns", "--request-deadline", "60"],
    )  # fmt: skip
    assert (s.role, s.worker_id, s.transfer_port_range, s.health_port) == ("prefill", "w1", (20000, 20001), 9001)
    assert (s.mesh.namespace, s.mesh.request_deadline, s.mesh.etcd_endpoints) == ("ns", 60.0, ("127.0.0.1:2",))
    auto = default_dtype()[0]  # no --dtype: the machine's choice
    assert s.engine == EngineSettings(
        max_num_seqs=8, kv_cache_bytes=32 * 2**20, enable_prefix_caching=False, engine_args='{"enforce_eager": true}', dtype=auto
    )
    default = worker_settings("decode", MESH)
    assert default.engine == EngineSettings(dtype=auto) and default.worker_id != worker_settings("decode", MESH).worker_id
    assert (default.lease_ttl, default.pin_ttl, default.drain_timeout, default.fault_pull_delay) == (5, 30, 60.0, 0.0)
    assert default.pin_write_delay == 1.0 and worker_settings("prefill", [*MESH, "--pin-write-delay", "0"]).pin_write_delay == 0


def test_worker_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "NATS_URL": "nats://n:4222", "ETCD_ENDPOINTS": "e1:2379, e2:2379", "WORKER_ID": "decode-0",
        "MAX_NUM_SEQS": "4", "KV_CACHE_MIB": "16", "PREFIX_CACHING": "0", "BLOCK_SIZE": "0", "NUM_THREADS": "0",
        "MAX_MODEL_LEN": "2048", "DRAIN_TIMEOUT": "5", "HEALTH_HOST": "0.0.0.0", "TRANSFER_PORTS": "21000-21001",
        "FAULT_PULL_DELAY": "1.5", "HEARTBEAT_INTERVAL": "0.25",
    }.items():  # fmt: skip
        monkeypatch.setenv(f"KVMESH_{name}", value)
    s = worker_settings("decode", [])
    assert (s.mesh.nats_url, s.mesh.etcd_endpoints, s.mesh.heartbeat_interval) == ("nats://n:4222", ("e1:2379", "e2:2379"), 0.25)
    assert (s.worker_id, s.drain_timeout, s.health_host, s.transfer_port_range, s.fault_pull_delay) == (
        "decode-0", 5.0, "0.0.0.0", (21000, 21001), 1.5,
    )  # fmt: skip
    # 0 is "not set" for the block size and the threads: the engine's default, torch's
    assert s.engine == EngineSettings(
        max_num_seqs=4, kv_cache_bytes=16 * 2**20, enable_prefix_caching=False, max_model_len=2048, dtype=default_dtype()[0]
    )
    monkeypatch.setenv("KVMESH_PREFIX_CACHING", "1")
    assert worker_settings("decode", []).engine.enable_prefix_caching


def test_mooncakes_own_port_variables_are_the_workers_range(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Mooncake listens on MC_MIN_RPC_PORT..MC_MAX_RPC_PORT when they are set: the worker takes
    them as its range, so that the bind guard fences those ports (it fenced Mooncake's default
    range, and the real listeners were on every interface); --transfer-ports still wins."""
    monkeypatch.setenv("MC_MIN_RPC_PORT", "21000")
    monkeypatch.setenv("MC_MAX_RPC_PORT", "21007")
    assert worker_settings("decode", MESH).transfer_port_range == (21000, 21007)
    assert worker_settings("decode", [*MESH, "--transfer-ports", "22000-22003"]).transfer_port_range == (22000, 22003)
    monkeypatch.setenv("MC_MAX_RPC_PORT", "40000")
    with pytest.raises(SystemExit):
        worker_settings("decode", MESH)
    assert "MC_MIN_RPC_PORT / MC_MAX_RPC_PORT: a transfer port range is MIN-MAX within 1024..32767" in capsys.readouterr().err
    monkeypatch.delenv("MC_MAX_RPC_PORT")
    assert worker_settings("decode", MESH).transfer_port_range is None  # one alone is not a range


def test_a_worker_flag_beats_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_MAX_NUM_SEQS", "4")
    monkeypatch.setenv("KVMESH_NATS_URL", "nats://from-env:1")
    monkeypatch.setenv("KVMESH_KV_CACHE_MIB", "not a number")  # a flag given: the variable is never read
    s = worker_settings("decode", [*MESH, "--max-num-seqs", "2", "--kv-cache-mib", "8"])
    assert (s.engine.max_num_seqs, s.engine.kv_cache_bytes, s.mesh.nats_url) == (2, 8 * 2**20, "nats://127.0.0.1:1")
    monkeypatch.delenv("KVMESH_KV_CACHE_MIB")
    parsed = worker_parser("decode").parse_args([])
    assert (parsed.max_num_seqs, parsed.nats_url) == (4, "nats://from-env:1")


@pytest.mark.parametrize(
    ("variable", "value", "error"),
    [
        ("KVMESH_KV_CACHE_MIB", "lots", "KVMESH_KV_CACHE_MIB='lots': must be an integer, got 'lots'"),
        ("KVMESH_DRAIN_TIMEOUT", "soon", "KVMESH_DRAIN_TIMEOUT='soon': must be a number, got 'soon'"),
        ("KVMESH_TRANSFER_PORTS", "20000-", "a port range is MIN-MAX, got '20000-'"),
        ("KVMESH_FAULT_PULL_DELAY", "x", "KVMESH_FAULT_PULL_DELAY='x': must be a number, got 'x'"),
        ("KVMESH_ENGINE_ARGS", "[1]", "--engine-args: must be a JSON object of EngineArgs fields"),
        ("KVMESH_HEARTBEAT_INTERVAL", "9", "the heartbeat interval must be positive and shorter than the silence timeout"),
        ("KVMESH_PIN_WRITE_DELAY", "30", "--pin-write-delay must be at least 0 and less than --pin-ttl (30), not 30"),
        ("KVMESH_PIN_WRITE_DELAY", "-1", "KVMESH_PIN_WRITE_DELAY='-1': must be 0 or more, got '-1'"),
        ("KVMESH_DTYPE", "fp8", "KVMESH_DTYPE='fp8': invalid choice: 'fp8' (choose from 'float32', 'bfloat16', 'float16', 'auto')"),
        # where the mesh is: refused at start, not retried for ever (or failing at every wait)
        ("KVMESH_REQUEST_TIMEOUT", "-1", "KVMESH_REQUEST_TIMEOUT='-1': must be more than 0, got '-1'"),
        ("KVMESH_REQUEST_DEADLINE", "0", "KVMESH_REQUEST_DEADLINE='0': must be more than 0, got '0'"),
        ("KVMESH_NAMESPACE", "a.b", "bad namespace 'a.b': one NATS token, no dots or wildcards"),
        ("KVMESH_HEALTH_PORT", "70000", "KVMESH_HEALTH_PORT='70000': must be a port number in 0..65535, got '70000'"),  # was an OverflowError at bind
    ],
)
def test_a_bad_worker_value_is_one_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, value: str, error: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_:
        worker_settings("decode", MESH)
    assert exit_.value.code == 2
    assert last_error(capsys) == f"kvmesh-decode-worker: error: {error}"


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        # each was a traceback from the engine after the model had loaded, or was accepted
        (["--kv-cache-mib", "-5"], "argument --kv-cache-mib: must be a positive integer, got '-5'"),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: must be a positive integer, got '0'"),
        (["--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens: must be a positive integer, got '0'"),
        (["--num-threads", "-1"], "argument --num-threads: must be a positive integer, got '-1'"),
        (["--lease-ttl", "0"], "argument --lease-ttl: must be a positive integer, got '0'"),
        (["--block-size", "0"], "argument --block-size: must be a positive integer, got '0'"),
        (["--load-interval", "0"], "argument --load-interval: must be more than 0, got '0'"),  # a busy loop
        (["--drain-timeout", "-1"], "argument --drain-timeout: must be 0 or more, got '-1'"),
        (["--heartbeat-interval", "nan"], "argument --heartbeat-interval: must be a finite number, got 'nan'"),
    ],
)
def test_a_worker_flag_out_of_range_is_one_error_line(capsys: pytest.CaptureFixture[str], flags: list[str], error: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        worker_settings("decode", [*MESH, *flags])
    assert exit_.value.code == 2
    assert last_error(capsys) == f"kvmesh-decode-worker: error: {error}"


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"name": "vllm", "tensor_parallel_size": 2}, None),  # a prefill worker's as a decode worker's
        ({"name": "vllm", "engine_args": '{"tensor_parallel_size": 2}'}, None),  # --engine-args' wins, as in vLLM
        ({"name": "vllm", "tensor_parallel_size": 2, "engine_args": '{"tensor_parallel_size": 1}'}, None),
        ({"name": "kvmesh", "tensor_parallel_size": 2}, "--tensor-parallel-size 2: vLLM's workers only (--engine vllm)"),
        ({"name": "vllm", "tensor_parallel_size": 2, "lend_cores": "/tmp/board:0"},
            "--tensor-parallel-size 2: its processes are bound to their cores; not with --lend-cores",
        ),
        ({"name": "vllm", "engine_args": '{"pipeline_parallel_size": 2}'},
            "pipeline parallel: not run by kvmesh's workers yet (vLLM's CPU backend fails it); use --tensor-parallel-size",
        ),
        ({"name": "vllm", "engine_args": '{"tensor_parallel_size": "two"}'},
            "--engine-args: tensor_parallel_size must be a positive whole number, not 'two'",
        ),
        ({"name": "vllm", "engine_args": "[2]"}, "--engine-args: must be a JSON object of EngineArgs fields"),
        (
            {"name": "vllm", "tensor_parallel_size": 2, "device": "cuda"},
            "--tensor-parallel-size 2 on cuda: kvmesh shares vLLM's ranks' KV pools on the CPU only yet",
        ),
        ({"name": "vllm", "tensor_parallel_size": 1, "device": "cuda"}, None),
    ],
)  # fmt: skip
def test_tensor_parallel_is_for_vllm_workers_that_lend_no_cores(fields: dict, error: str | None) -> None:
    """Either role: a tensor-parallel pool is shared with the worker's process, pulled from and into."""
    from kvmesh.settings.worker import EngineSettings
    from kvmesh.worker.engines import parallel_problem

    assert parallel_problem(EngineSettings(**fields)) == error


def test_a_kvmesh_worker_refuses_tensor_parallel_in_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_TENSOR_PARALLEL_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        worker_settings("prefill", MESH)
    assert exit_.value.code == 2
    assert last_error(capsys) == "kvmesh-prefill-worker: error: --tensor-parallel-size 2: vLLM's workers only (--engine vllm)"
    monkeypatch.delenv("KVMESH_TENSOR_PARALLEL_SIZE")
    assert worker_settings("decode", MESH).engine.tensor_parallel_size == 1


def test_a_vllm_block_size_its_cpu_backend_refuses_is_named() -> None:
    from kvmesh.worker.engines import block_size_problem

    assert block_size_problem("vllm", "cpu", 48) == "--block-size 48: vLLM on CPU takes a multiple of 32"
    assert block_size_problem("vllm", "cuda", 16) is None and block_size_problem("kvmesh", "cpu", 7) is None


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        # peers would have dialled it; a listener would have failed after the model loaded
        (["--advertise-host", "bad host!"], "argument --advertise-host: must be an IP address or a host name, got 'bad host!'"),
        (["--health-host", "a..b"], "argument --health-host: must be an IP address or a host name, got 'a..b'"),
        (["--nats-tls-ca", "{binary}"], "--nats-tls-ca {binary}: not UTF-8 text (byte 0 is 0xff)"),  # was a traceback
    ],
)
def test_a_bad_address_or_file_is_one_error_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], error: str) -> None:
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00 not text")
    with pytest.raises(SystemExit) as exit_:
        worker_settings("decode", [*MESH, *(flag.replace("{binary}", str(binary)) for flag in flags)])
    assert exit_.value.code == 2
    assert last_error(capsys) == f"kvmesh-decode-worker: error: {error.replace('{binary}', str(binary))}"


def test_hosts_a_service_is_given_are_addresses_or_names() -> None:
    for host in ("127.0.0.1", "0.0.0.0", "::", "[::1]", "fe80::1", "localhost", "kv-metadata", "kvmesh_router_1", "a.example.", "auto"):
        assert host_address(host) == host
    for host in ("", "bad host!", "a..b", "-a", "a-", "x" * 64, "http://a", "a:80", ("a." * 127) + "bc"):
        with pytest.raises(ValueTextError, match="must be an IP address or a host name"):
            host_address(host)


def test_a_settings_file_that_is_not_text_is_said_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    binary = tmp_path / "keys.bin"
    binary.write_bytes(b"\x80abc")
    for flag in ("--api-key-file", "--rate-limits", "--routing-config"):
        with pytest.raises((SystemExit, ScorerConfigError)) as raised:
            router_settings([*MESH, flag, str(binary)])
            read_scorer_config(binary)  # the router reads its routing config at start, not in its settings
        said = last_error(capsys) if raised.type is SystemExit else str(raised.value)
        assert said.endswith(f"{binary}: not UTF-8 text (byte 0 is 0x80)"), said


def test_zero_in_a_variable_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_BLOCK_SIZE", "0")
    monkeypatch.setenv("KVMESH_NUM_THREADS", "0")
    engine = worker_settings("decode", MESH).engine
    assert (engine.block_size, engine.num_threads) == (16, None)


@pytest.mark.parametrize(
    ("nats", "etcd", "error"),
    [
        ("http://n", "e:1", "--nats-url: 'http://n' is not [nats://|tls://]host[:port]"),
        ("nats://u:pw@n:99999", "e:1", "--nats-url: 'n:99999' is not [nats://|tls://]host[:port]"),  # no password shown
        ("nats://n", "e:1,e", "--etcd: 'e' is not [http://|https://]host:port"),
    ],
)
def test_where_the_mesh_is_must_be_an_address(capsys: pytest.CaptureFixture[str], nats: str, etcd: str, error: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        worker_settings("decode", ["--nats-url", nats, "--etcd", etcd])
    assert exit_.value.code == 2
    assert last_error(capsys) == f"kvmesh-decode-worker: error: {error}"


def test_a_bad_worker_flag_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        worker_settings("decode", [*MESH, "--kv-cache-mib", "lots"])
    assert last_error(capsys) == "kvmesh-decode-worker: error: argument --kv-cache-mib: must be an integer, got 'lots'"
    with pytest.raises(SystemExit):
        worker_settings("decode", ["--etcd", "e:1"])
    assert last_error(capsys) == "kvmesh-decode-worker: error: --nats-url (or KVMESH_NATS_URL) is required"


# -- the router ---------------------------------------------------------------------------------
def test_router_settings_from_flags(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice:sk-alice-1\n")
    s = router_settings(
        [*MESH, "--host", "0.0.0.0", "--port", "0", "--served-model-name", "m", "--api-key-file", str(keys),
         "--auth-metrics", "--cors-allow-origins", "http://a.example/,*", "--max-attempts", "2",
         "--max-body-bytes", "1000", "--generation-config", "vllm", "--rate-limit-store", "nats"],
    )  # fmt: skip
    assert (s.host, s.port, s.served_model_name, s.max_attempts, s.generation_config) == ("0.0.0.0", 0, "m", 2, "vllm")
    assert (s.auth_metrics, s.auth_docs, s.cors_allow_origins, s.rate_limit_store) == (True, False, ("http://a.example", "*"), "nats")
    assert s.limits.max_body_bytes == 1000 and s.limits.header_timeout == 10.0
    assert s.api_keys is not None and s.api_keys.names == ["alice"] and s.rate_limit_config is None
    default = router_settings(MESH)
    assert (default.host, default.port, default.generation_config, default.api_keys, default.cors_allow_origins) == (
        "127.0.0.1", 8000, "auto", None, (),
    )  # fmt: skip


def test_router_settings_from_the_environment_and_flags_beating_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "NATS_URL": "nats://n:1", "ETCD_ENDPOINTS": "e:1", "ROUTER_HOST": "0.0.0.0", "ROUTER_PORT": "8001",
        "MAX_BODY_BYTES": "2048", "BODY_TIMEOUT": "3", "CORS_ALLOW_ORIGINS": "http://b.example", "API_KEY": "sk-env",
        "AUTH_DOCS": "yes", "ROUTING_CONFIG": "/r.yaml", "MODEL": "/m",
    }.items():  # fmt: skip
        monkeypatch.setenv(f"KVMESH_{name}", value)
    s = router_settings([])
    assert (s.host, s.port, s.model, s.routing_config, s.cors_allow_origins) == ("0.0.0.0", 8001, "/m", "/r.yaml", ("http://b.example",))
    assert (s.limits.max_body_bytes, s.limits.body_timeout, s.auth_docs) == (2048, 3.0, True)
    assert s.api_keys is not None and s.api_keys.names == ["default"]
    s = router_settings(["--port", "9", "--max-body-bytes", "4096", "--cors-allow-origins", "*"])
    assert (s.port, s.limits.max_body_bytes, s.cors_allow_origins, s.host) == (9, 4096, ("*",), "0.0.0.0")


@pytest.mark.parametrize(
    ("variable", "value", "error"),
    [
        ("KVMESH_ROUTER_PORT", "http", "KVMESH_ROUTER_PORT='http': must be an integer, got 'http'"),
        ("KVMESH_RATE_LIMIT_STORE", "redis", "KVMESH_RATE_LIMIT_STORE='redis': invalid choice: 'redis' (choose from 'local', 'nats')"),
        ("KVMESH_MAX_HEADER_BYTES", "10", "max_header_bytes must be >= 1024, got 10"),
        ("KVMESH_KV_QUERY_TIMEOUT", "0", "KVMESH_KV_QUERY_TIMEOUT='0': must be more than 0, got '0'"),
        ("KVMESH_AUTH_METRICS", "1", "--auth-metrics / --auth-docs need API keys: give --api-key-file or KVMESH_API_KEY"),
        ("KVMESH_API_KEY_FILE", "/nowhere/keys", "cannot read the API key file /nowhere/keys"),
        ("KVMESH_GENERATION_CONFIG", "/nowhere", "--generation-config /nowhere: not auto, vllm or a directory"),  # it only warned
        ("KVMESH_ROUTER_PORT", "70000", "KVMESH_ROUTER_PORT='70000': must be a port number in 0..65535, got '70000'"),
    ],
)
def test_a_bad_router_value_is_one_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, value: str, error: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_:
        router_settings(MESH)
    assert exit_.value.code == 2
    assert last_error(capsys).startswith(f"kvmesh-router: error: {error}")


# -- kv-metadata --------------------------------------------------------------------------------
def test_kv_metadata_settings_from_flags_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    s = kv_metadata_settings([*MESH, "--service-id", "kvm-1", "--mirror-interval", "0.5", "--health-port", "9100"])
    assert (s.service_id, s.mirror_interval, s.ingest_span_interval, s.health_port) == ("kvm-1", 0.5, 10.0, 9100)
    assert kv_metadata_settings(MESH).service_id.startswith("kv-metadata-")  # its id, as logged at start
    for name, value in {"NATS_URL": "nats://n:1", "ETCD_ENDPOINTS": "e:1", "SERVICE_ID": "kvm-env", "INGEST_SPAN_INTERVAL": "2", "HEALTH_HOST": "0.0.0.0"}.items():
        monkeypatch.setenv(f"KVMESH_{name}", value)
    s = kv_metadata_settings([])
    assert (s.mesh.nats_url, s.service_id, s.ingest_span_interval, s.health_host) == ("nats://n:1", "kvm-env", 2.0, "0.0.0.0")
    assert kv_metadata_settings(["--service-id", "kvm-flag"]).service_id == "kvm-flag"


def test_a_bad_kv_metadata_value_is_one_error_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVMESH_MIRROR_INTERVAL", "often")
    with pytest.raises(SystemExit):
        kv_metadata_settings(MESH)
    assert last_error(capsys) == "kvmesh-kv-metadata: error: KVMESH_MIRROR_INTERVAL='often': must be a number, got 'often'"
    monkeypatch.delenv("KVMESH_MIRROR_INTERVAL")
    with pytest.raises(SystemExit):
        kv_metadata_settings([*MESH, "--ingest-span-interval", "0"])
    assert last_error(capsys) == "kvmesh-kv-metadata: error: argument --ingest-span-interval: must be more than 0, got '0'"


# -- start-up -----------------------------------------------------------------------------------
async def test_the_settings_are_logged_once_at_start_with_secrets_masked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice:sk-alice-secret\n")
    settings = router_settings(["--nats-url", "nats://user:hunter2@n:4222", "--etcd", "e:1", "--api-key-file", str(keys)])
    values = settings_values(settings)
    assert values["mesh.nats_url"] == "nats://user:***@n:4222"
    assert values["api_key_file"] == str(keys) and values["limits.max_body_bytes"] == 4 * 2**20
    assert "api_keys" not in values and "rate_limit_config" not in values  # loaded, never logged
    with caplog.at_level(logging.INFO, logger="kvmesh.telemetry"):
        assert await start_service("router", settings) is settings
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("router settings: ")]
    assert len(lines) == 1
    assert "mesh.nats_url=nats://user:***@n:4222" in lines[0] and "hunter2" not in lines[0] and "sk-alice" not in lines[0]
    worker = settings_values(worker_settings("decode", [*MESH, "--max-num-seqs", "3"]))
    assert worker["engine.max_num_seqs"] == 3 and worker["role"] == "decode"


async def test_a_service_waits_for_sigterm_or_its_own_stop() -> None:
    waiting = asyncio.ensure_future(until_signalled())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    os.kill(os.getpid(), signal.SIGTERM)  # handled by the loop: the test process lives on
    await asyncio.wait_for(waiting, 5)
    stop = asyncio.Event()
    waiting = asyncio.ensure_future(until_signalled(stop))
    await asyncio.sleep(0.05)
    stop.set()  # an engine that died, say
    await asyncio.wait_for(waiting, 5)


def test_the_engine_settings_are_the_engines_own_fields() -> None:
    """kvmesh's engine takes every field its ``EngineConfig`` shares with ``EngineSettings``
    (none copied by hand): a field renamed on one side and not the other shows here."""
    from dataclasses import fields

    from kvmesh.engine.llm_engine import EngineConfig

    shared = {f.name for f in fields(EngineConfig)} & {f.name for f in fields(EngineSettings)}
    assert shared == {
        "model", "served_model_name", "device", "dtype", "block_size", "kv_cache_bytes", "max_num_seqs",
        "max_num_batched_tokens", "enable_prefix_caching", "num_threads",
    }  # fmt: skip
    # vLLM's, which engine, and the worker's lending board (``KvmeshEngine.start`` takes it to ``AsyncEngine``)
    assert {f.name for f in fields(EngineSettings)} - shared == {"name", "max_model_len", "cpu_bind", "engine_args", "tensor_parallel_size", "lend_cores"}


def test_the_docs_can_list_every_variable() -> None:
    rows = env.table().splitlines()
    assert len(rows) == 2 + len(env.REGISTRY)
    assert "| `KVMESH_HEALTH_PORT` | int | prefill-worker, decode-worker, kv-metadata | port of /health and /metrics (0: a free one) |" in rows


async def test_what_a_service_prepares_first_gives_the_settings_it_logs_and_runs_with(caplog: pytest.LogCaptureFixture) -> None:
    """A worker's bind guard (and anything else that must come before the settings are
    logged, such as an identity that replaces the id) runs first; its settings are logged."""
    import dataclasses

    settings = kv_metadata_settings([*MESH, "--service-id", "kvm-before"])
    order: list[str] = []

    async def prepare():
        order.append("prepared")
        return dataclasses.replace(settings, service_id="kvm-after")

    with caplog.at_level(logging.INFO, logger="kvmesh.telemetry"):
        got = await start_service("kv-metadata", settings, instance="service_id", prepare=prepare)
    assert got.service_id == "kvm-after" and order == ["prepared"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv-metadata settings: ")]
    assert len(lines) == 1 and "service_id=kvm-after" in lines[0] and "kvm-before" not in lines[0]


def test_the_kv_query_timeout_is_a_router_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert router_settings(MESH).kv_query_timeout == 0.05
    monkeypatch.setenv("KVMESH_KV_QUERY_TIMEOUT", "0.25")
    assert router_settings(MESH).kv_query_timeout == 0.25
    assert router_settings([*MESH, "--kv-query-timeout", "1"]).kv_query_timeout == 1.0


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--mirror-interval", "-1"], "argument --mirror-interval: must be more than 0, got '-1'"),  # it was accepted
        (["--health-port", "70000"], "argument --health-port: must be a port number in 0..65535, got '70000'"),
    ],
)
def test_a_bad_kv_metadata_flag_is_one_error_line(capsys: pytest.CaptureFixture[str], flags: list[str], error: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        kv_metadata_settings([*MESH, *flags])
    assert exit_.value.code == 2
    assert last_error(capsys) == f"kvmesh-kv-metadata: error: {error}"
