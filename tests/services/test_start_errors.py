"""A service started as a deployment starts it (``python -m kvmesh.services.<name>``) that
cannot start as configured ends with one line, ``kvmesh-<service>: error: ...``, and exit
code 1: not a traceback, not a retry for ever. Ctrl-C while it waits ends it quietly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.infra.servers import EtcdServer, NatsServer, start_etcd, start_nats


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, EtcdServer]]:
    nats = start_nats(tmp_path_factory.mktemp("nats"))
    etcd = start_etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield nats, etcd
    finally:
        nats.stop()
        etcd.stop()


def service(name: str, *args: str, nats_url: str, etcd: str, cache: Path) -> subprocess.Popen[str]:
    """The service as a deployment runs it, the default model from the session's cache (a
    router reads its tokenizer before it connects: never a conversion in ~/.cache here)."""
    env = {**os.environ, "KVMESH_NATS_URL": nats_url, "KVMESH_ETCD_ENDPOINTS": etcd, "KVMESH_CACHE_DIR": str(cache)}
    return subprocess.Popen(
        [sys.executable, "-m", f"kvmesh.services.{name}", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # a Ctrl-C reaches it as it would from a terminal (a background job's SIGINT is ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


# gRPC's own log lines ("E1207 22:31:01.969276   29808 ev_epoll1_linux.cc:309] epoll_ctl failed:
# ..."): its fork handlers write them in the child between fork and exec (``preexec_fn`` makes
# Python fork) when this test process has gRPC threads of its own, from another test's etcd
# client. They are not the service's.
GRPC_LOG_LINE = re.compile(r"[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")


def ended(process: subprocess.Popen[str], timeout: float = 60) -> tuple[int, list[str]]:
    """The exit code and the lines on stderr that are not the service's own log lines."""
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise AssertionError(f"still running after {timeout}s") from None
    lines = [
        line
        for line in err.splitlines()
        if not line.startswith("{") and " INFO " not in line and " WARNING " not in line and not GRPC_LOG_LINE.match(line)
    ]
    return process.returncode, lines


@pytest.mark.parametrize(
    ("name", "args", "error"),
    [
        # each was taken: a busy loop of load reports, a request never tried, ...
        ("decode_worker", ["--load-interval", "0"], "kvmesh-decode-worker: error: argument --load-interval: must be more than 0, got '0'"),
        ("prefill_worker", ["--advertise-host", "bad host!"], "kvmesh-prefill-worker: error: argument --advertise-host: must be an IP address or a host name, got 'bad host!'"),
        ("router", ["--max-attempts", "0"], "kvmesh-router: error: argument --max-attempts: must be a positive integer, got '0'"),
        ("kv_metadata", ["--ingest-span-interval", "nan"], "kvmesh-kv-metadata: error: argument --ingest-span-interval: must be a finite number, got 'nan'"),
    ],
)
def test_a_service_refuses_a_value_out_of_range_in_one_line(servers, default_model_dir, name, args, error) -> None:
    nats, etcd = servers
    code, lines = ended(service(name, *args, nats_url=nats.address, etcd=etcd.address, cache=default_model_dir.parent.parent))
    assert (code, lines) == (2, [error])


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--host", "no-such-host.invalid"], "kvmesh-router: error: cannot listen on no-such-host.invalid port 0:"),
        (["--routing-config", "{tmp}/routing.txt"], "kvmesh-router: error: {tmp}/routing.txt: a scorer config is a .json, .yaml or .yml file"),
        (["--model", "/nonexistent/model"], "kvmesh-router: error: unknown model '/nonexistent/model'"),
    ],
)
def test_a_router_that_cannot_start_says_why_in_one_line(servers, default_model_dir, tmp_path, args, error) -> None:
    nats, etcd = servers
    (tmp_path / "routing.txt").write_text("prefix: 2\n")
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    cache = default_model_dir.parent.parent
    code, lines = ended(service("router", "--port", "0", *args, nats_url=nats.address, etcd=etcd.address, cache=cache))
    assert code == 1, lines
    assert len(lines) == 1 and lines[0].startswith(error.replace("{tmp}", str(tmp_path))), lines


def test_a_router_gives_up_on_a_nats_that_does_not_answer(servers, default_model_dir) -> None:
    _, etcd = servers
    began = time.monotonic()
    router = service(
        "router", "--port", "0", "--request-timeout", "2",
        nats_url="nats://127.0.0.1:1", etcd=etcd.address, cache=default_model_dir.parent.parent,
    )  # fmt: skip
    code, lines = ended(router, timeout=30)  # it tried for ever
    assert (code, lines) == (
        1,
        ["kvmesh-router: error: NATS at nats://127.0.0.1:1 did not answer within 2s (--request-timeout): "
         "[Errno 111] Connect call failed ('127.0.0.1', 1)"],
    )  # fmt: skip
    assert time.monotonic() - began < 20


def test_ctrl_c_while_a_service_waits_for_nats_ends_it_quietly(servers, default_model_dir) -> None:
    _, etcd = servers
    router = service("router", "--port", "0", nats_url="nats://127.0.0.1:1", etcd=etcd.address, cache=default_model_dir.parent.parent)
    time.sleep(3)  # started and waiting
    assert router.poll() is None
    router.send_signal(signal.SIGINT)
    assert ended(router, timeout=10) == (130, [])


def test_a_worker_whose_kv_pool_holds_no_block_says_so_in_one_line(servers, default_model_dir) -> None:
    nats, etcd = servers
    worker = service(
        "decode_worker", "--block-size", "100000", "--kv-cache-mib", "64", "--dtype", "float32",
        nats_url=nats.address, etcd=etcd.address, cache=default_model_dir.parent.parent,
    )  # fmt: skip
    code, lines = ended(worker)
    assert (code, lines) == (1, [f"kvmesh-decode-worker: error: a KV budget of {64 * 2**20} bytes does not hold one 4608000000-byte block"])


def test_a_worker_that_cannot_listen_for_health_checks_says_so_in_one_line(servers, default_model_dir) -> None:
    nats, etcd = servers
    worker = service(
        "prefill_worker", "--health-host", "no-such-host.invalid",
        nats_url=nats.address, etcd=etcd.address, cache=default_model_dir.parent.parent,
    )  # fmt: skip
    code, lines = ended(worker)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("kvmesh-prefill-worker: error: cannot listen on no-such-host.invalid port 0:"), lines
