"""The bind guard (``kvmesh/transfer/bind_guard.c``, LD_PRELOAD) in small Python processes: a
bind to the unspecified address on a port of the range lands on the given address (IPv4, or
its IPv4-mapped address for a dual-stack IPv6 socket; a v6-only socket is refused), every
other bind is untouched; a worker-style process executes itself once, same PID, to load it,
and without a compiler says so in one warning line. Loopback only."""

from __future__ import annotations

import errno
import json
import os
import random
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvmesh.transfer import bind_guard

HOST = "127.0.0.3"  # a loopback address other than 127.0.0.1, so that the rewrite shows

pytestmark = pytest.mark.skipif(bind_guard.compiler() is None, reason="no C compiler")

PROBE = textwrap.dedent(
    """
    import errno, json, socket, sys
    low, high, outside = (int(a) for a in sys.argv[1:4])
    def bound(family, address, v6only=None):
        s = socket.socket(family, socket.SOCK_STREAM)
        if v6only is not None:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
        try:
            s.bind(address)
        except OSError as exc:
            return errno.errorcode[exc.errno]
        s.listen()
        keep.append(s)
        return list(s.getsockname()[:2])
    keep = []
    print(json.dumps({
        "any_in_range": bound(socket.AF_INET, ("0.0.0.0", low)),
        "any_last_in_range": bound(socket.AF_INET, ("0.0.0.0", high)),
        "any_outside": bound(socket.AF_INET, ("0.0.0.0", outside)),
        "any_ephemeral": bound(socket.AF_INET, ("0.0.0.0", 0)),
        "specific_in_range": bound(socket.AF_INET, ("127.0.0.1", low + 1)),
        "v6_any_in_range": bound(socket.AF_INET6, ("::", low + 2), v6only=0),
        "v6_only_in_range": bound(socket.AF_INET6, ("::", low + 3), v6only=1),
    }))
    """
)


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free now (on every interface)."""
    for base in random.sample(range(20000, 32000, 50), 50):
        probes = []
        try:
            for port in range(base, base + count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError("no free ports")


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    path = bind_guard.library(tmp_path_factory.mktemp("cache"))
    assert path is not None and path.exists()
    return path


def probe(env: dict[str, str], low: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(low), str(low + 3), str(low + 4)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_binds_to_any_address_in_the_range_land_on_the_given_address(library):
    low = free_ports(5)
    env = bind_guard.preload_env(library, bind_guard.guard_env(HOST, (low, low + 3)))
    seen = probe(env, low)
    assert seen["any_in_range"] == [HOST, low]
    assert seen["any_last_in_range"] == [HOST, low + 3]
    assert seen["v6_any_in_range"] == [f"::ffff:{HOST}", low + 2]  # dual stack: the IPv4 address alone
    assert seen["v6_only_in_range"] == errno.errorcode[errno.EADDRNOTAVAIL]  # could not serve HOST: refused
    assert seen["specific_in_range"] == ["127.0.0.1", low + 1]  # an explicit address is left alone
    assert seen["any_outside"] == ["0.0.0.0", low + 4]  # outside the range: untouched
    assert seen["any_ephemeral"][0] == "0.0.0.0"


def test_the_mapped_listener_takes_ipv4_connections_on_the_given_address_only(library):
    low = free_ports(1)
    code = textwrap.dedent(
        f"""
        import socket
        server = socket.socket(socket.AF_INET6)
        server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        server.bind(("::", {low}))
        server.listen()
        socket.create_connection(("{HOST}", {low}), timeout=5).close()
        try:
            socket.create_connection(("127.0.0.1", {low}), timeout=5)
        except ConnectionRefusedError:
            print("refused on 127.0.0.1")
        """
    )
    env = bind_guard.preload_env(library, bind_guard.guard_env(HOST, (low, low)))
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "refused on 127.0.0.1"


def test_without_its_environment_the_guard_changes_nothing(library):
    low = free_ports(5)
    seen = probe(bind_guard.preload_env(library, {}), low)
    assert seen["any_in_range"] == ["0.0.0.0", low]
    assert seen["v6_any_in_range"] == ["::", low + 2]


WORKER = textwrap.dedent(
    """
    import logging, os, socket, sys
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
    print("start", os.getpid(), flush=True)
    from kvmesh.transfer import bind_guard
    state = bind_guard.enforce(sys.argv[1], (int(sys.argv[2]), int(sys.argv[2])))
    s = socket.socket()
    s.bind(("0.0.0.0", int(sys.argv[2])))
    print("state", state, os.getpid(), s.getsockname()[0], bind_guard.loaded(), flush=True)
    """
)


def worker(tmp_path: Path, host: str, port: int, **env: str) -> list[str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CC")}
    environment.update(KVMESH_CACHE_DIR=str(tmp_path), **env)
    result = subprocess.run(
        [sys.executable, "-c", WORKER, host, str(port)], env=environment, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_a_worker_executes_itself_once_with_the_guard_then_binds_the_advertised_address(tmp_path):
    port = free_ports(1)
    lines = worker(tmp_path, HOST, port)
    starts = [line for line in lines if line.startswith("start")]
    assert len(starts) == 2 and starts[0] == starts[1]  # executed again once, same PID
    pid = starts[0].split()[1]
    assert lines[-1] == f"state loaded {pid} {HOST} True"
    assert list(tmp_path.glob("bind_guard-*.so"))  # built into the cache dir
    assert not [line for line in lines if line.startswith("WARNING")]


def test_a_worker_without_a_compiler_warns_once_and_listens_as_before(tmp_path):
    port = free_ports(1)
    lines = worker(tmp_path, HOST, port, CC=str(tmp_path / "no-cc"))
    assert len([line for line in lines if line.startswith("start")]) == 1  # not executed again
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert len(warnings) == 1 and "listen on every interface" in warnings[0] and "C compiler" in warnings[0]
    assert lines[-1].startswith("state off") and lines[-1].endswith("0.0.0.0 False")


@pytest.mark.parametrize("host", ["0.0.0.0", "::1", "worker-0.local"])
def test_no_guard_without_a_specific_ipv4_host(tmp_path, host):
    lines = worker(tmp_path, host, free_ports(1))
    assert len([line for line in lines if line.startswith("WARNING")]) == 1
    assert lines[-1].startswith("state off")


MOONCAKE_WORKER = textwrap.dedent(
    """
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
    from kvmesh.settings.worker import worker_settings
    from kvmesh.transfer import bind_guard
    from kvmesh.transfer.mooncake_agent import MooncakeAgent
    from tests.mesh.meshes import listening
    import os
    s = worker_settings("decode", ["--nats-url", "nats://127.0.0.1:1", "--etcd", "127.0.0.1:2", "--advertise-host", sys.argv[1]])
    bind_guard.enforce(s.advertise_host, s.transfer_port_range)  # as WorkerRuntime.prepare, then start
    agent = MooncakeAgent(s.advertise_host, port_range=s.transfer_port_range)
    print("RESULT", json.dumps({"range": s.transfer_port_range, "endpoint": agent.endpoint, "listening": listening(os.getpid())}))
    """
)


def test_a_worker_fences_the_ports_mooncakes_own_variables_give(tmp_path):
    """MC_MIN_RPC_PORT / MC_MAX_RPC_PORT in a worker's environment: Mooncake listens there,
    and so the guard fences that range (it fenced Mooncake's default range, and the worker's
    two real listeners were on every interface). A real worker's settings, guard and engine."""
    low = free_ports(8)
    environment = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CC")}
    environment.update(KVMESH_CACHE_DIR=str(tmp_path), MC_MIN_RPC_PORT=str(low), MC_MAX_RPC_PORT=str(low + 7))
    result = subprocess.run(
        [sys.executable, "-c", MOONCAKE_WORKER, HOST], env=environment, capture_output=True, text=True, timeout=60,
        cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    seen = json.loads(line.removeprefix("RESULT "))
    assert seen["range"] == [low, low + 7] and seen["endpoint"].startswith(f"{HOST}:")
    transfer = [(address, port) for address, port in seen["listening"] if low <= port <= low + 7]
    assert len(transfer) == 2 and {address for address, _ in transfer} <= {HOST, f"::ffff:{HOST}"}, seen
    assert "listen on every interface" not in result.stdout
