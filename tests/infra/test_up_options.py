"""``kvmesh up`` takes the router's and the workers' options and hands on exactly those given,
shows its defaults in ``--help``, has ``--version``, and refuses a bad service option before
anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh import __version__
from kvmesh.cli import build_parser
from kvmesh.infra.up import SERVICE_OPTIONS, service_args
from kvmesh.settings.router import router_parser
from kvmesh.settings.worker import worker_parser


def up_args(*argv: str):
    return build_parser().parse_args(["up", *argv])


def test_nothing_given_nothing_forwarded() -> None:
    assert service_args(up_args()) == ([], [], {})


def test_what_is_given_goes_where_it_belongs(tmp_path: Path) -> None:
    limits = tmp_path / "limits.json"
    args = up_args(
        "--served-model-name", "foo",
        "--cors-allow-origins", "http://a.example,http://b.example",
        "--auth-docs",
        "--rate-limits", str(limits),
        "--generation-config", "vllm",
        "--max-body-bytes", "1000",
        "--max-num-seqs", "8",
        "--engine", "vllm",
        "--max-model-len", "2048",
        "--engine-args", '{"enforce_eager": true}',
        "--request-deadline", "60",
        "--silence-timeout", "2.5",
    )  # fmt: skip
    router, workers, env = service_args(args)
    assert router == [
        "--served-model-name", "foo",
        "--rate-limits", str(limits.resolve()),
        "--auth-docs",
        "--cors-allow-origins", "http://a.example,http://b.example",
        "--generation-config", "vllm",
        "--max-body-bytes", "1000",
    ]  # fmt: skip
    assert workers == ["--served-model-name", "foo", "--max-model-len", "2048", "--max-num-seqs", "8", "--engine-args", '{"enforce_eager": true}']
    assert env == {"KVMESH_REQUEST_DEADLINE": "60.0", "KVMESH_SILENCE_TIMEOUT": "2.5"}


def test_every_forwarded_flag_is_the_services_own() -> None:
    """A flag handed on is one the service parses, with the value as kvmesh up rendered it."""
    router_flags = {a for action in router_parser()._actions for a in action.option_strings}
    worker_flags = {a for action in worker_parser("decode")._actions for a in action.option_strings}
    for option in SERVICE_OPTIONS:
        if option.to in ("router", "both"):
            assert option.flag in router_flags, option.flag
        if option.to in ("workers", "both"):
            assert option.flag in worker_flags, option.flag
        if option.to == "env":
            assert option.flag in router_flags and option.flag in worker_flags, option.flag
    router, workers, _ = service_args(
        up_args("--served-model-name", "foo", "--cors-allow-origins", "*", "--max-attempts", "2", "--max-num-seqs", "4")
    )
    mesh = ["--nats-url", "nats://127.0.0.1:1", "--etcd", "127.0.0.1:2"]
    parsed = router_parser().parse_args([*mesh, *router])
    assert (parsed.served_model_name, parsed.cors_allow_origins, parsed.max_attempts) == ("foo", ("*",), 2)
    parsed = worker_parser("decode").parse_args([*mesh, *workers])
    assert (parsed.served_model_name, parsed.max_num_seqs) == ("foo", 4)


def kvmesh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", *args], capture_output=True, text=True, timeout=60, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})


def test_help_shows_the_defaults_and_version() -> None:
    done = kvmesh("up", "--help")
    assert done.returncode == 0
    for line in (
        "--prefill PREFILL",
        "prefill workers (0: decode workers prefill themselves) (default: 1)",
        "--kv-cache-mib KV_CACHE_MIB",
        "KV pool per worker (default: 256)",
        "--dtype {float32,bfloat16,float16,auto}",
        "float32 (KVMESH_DTYPE) (default: auto)",
        "tries per request (default: 3)",
        "requests a worker batches at most (default: 64)",
    ):
        assert line in done.stdout, line
    assert "(default: None)" not in done.stdout
    for argv in (["--version"], ["up", "--version"]):
        done = kvmesh(*argv)
        assert (done.returncode, done.stdout) == (0, f"kvmesh {__version__}\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine-args", "[1]"], "kvmesh up: error: --engine-args: must be a JSON object of EngineArgs fields\n"),
        (["--engine-args", "{"], "kvmesh up: error: --engine-args: not JSON"),
        (["--engine-args", "{}"], "kvmesh up: error: --engine-args is only for vLLM's workers: give --engine vllm, or leave it out\n"),
        (["--max-model-len", "2048"], "kvmesh up: error: --max-model-len is only for vLLM's workers: give --engine vllm, or leave it out\n"),
        (["--max-attempts", "0"], "kvmesh up: error: argument --max-attempts: must be a positive integer, got '0'"),
        (["--max-body-bytes", "0"], "kvmesh up: error: argument --max-body-bytes: must be a positive integer, got '0'"),
        (["--max-num-seqs", "0"], "kvmesh up: error: argument --max-num-seqs: must be a positive integer, got '0'"),
        (["--max-num-batched-tokens", "-5"], "kvmesh up: error: argument --max-num-batched-tokens: must be a positive integer"),
        (["--body-timeout", "-1"], "kvmesh up: error: argument --body-timeout: must be more than 0, got '-1'"),
        (["--request-deadline", "nan"], "kvmesh up: error: argument --request-deadline: must be a finite number, got 'nan'"),
        (["--silence-timeout", "0"], "kvmesh up: error: argument --silence-timeout: must be more than 0"),
        (["--drain-timeout", "-1"], "kvmesh up: error: argument --drain-timeout: must be 0 or more"),
        (["--pin-write-delay", "-1"], "kvmesh up: error: argument --pin-write-delay: must be 0 or more"),
        (["--pin-write-delay", "30"], "kvmesh up: error: --pin-write-delay must be less than --pin-ttl (30), not 30\n"),
        (["--pin-ttl", "5", "--pin-write-delay", "7.5"], "kvmesh up: error: --pin-write-delay must be less than --pin-ttl (5), not 7.5\n"),
        (["--auth-docs"], "kvmesh up: error: --auth-metrics / --auth-docs need API keys: give --api-key-file or KVMESH_API_KEY\n"),
        (["--generation-config", "/nonexistent"], "kvmesh up: error: --generation-config /nonexistent: not auto, vllm or a directory\n"),
        (["--rate-limits", "/nonexistent.json"], "kvmesh up: error: --rate-limits: "),
        (["--routing-config", "/nonexistent.json"], "kvmesh up: error: --routing-config: cannot read scorer config /nonexistent.json"),
        (["--max-num-seqs", "many"], "kvmesh up: error: argument --max-num-seqs: must be an integer, got 'many'"),
    ],
)
def test_a_bad_service_option_fails_before_anything_starts(tmp_path: Path, args: list[str], message: str) -> None:
    done = kvmesh("up", "--port", "0", "--workdir", str(tmp_path / "w"), *args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(message), done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == ""
    assert not (tmp_path / "w" / "logs").exists()
