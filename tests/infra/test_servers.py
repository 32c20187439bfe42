"""Real nats-server and etcd, started on free ports and stopped by PID; children that die
with their parent; servers restarted on the same port with their data."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import nats
import pytest
from etcd3aio import Etcd3Client

from kvmesh.infra.processes import ManagedProcess, ProcessStartError, stop_all
from kvmesh.infra.servers import start_etcd, start_nats
from tests.mesh.meshes import process_gone


async def test_nats_server_request_reply_with_headers(tmp_path):
    server = await asyncio.to_thread(start_nats, tmp_path)
    try:
        assert server.port > 0 and server.process.is_running()
        nc = await nats.connect(server.url, connect_timeout=5)

        async def echo(msg):
            await msg.respond(msg.data + (msg.headers or {}).get("h", "").encode())

        sub = await nc.subscribe("echo", cb=echo)
        reply = await nc.request("echo", b"hi ", headers={"h": "there"}, timeout=5)
        assert reply.data == b"hi there"
        await sub.unsubscribe()
        await nc.close()
    finally:
        server.stop()
    assert not server.process.is_running()


async def test_etcd_put_get_and_lease_expiry(tmp_path):
    server = await asyncio.to_thread(start_etcd, tmp_path)
    try:
        async with Etcd3Client([server.endpoint]) as client:
            await client.kv.put("/k", "v", timeout=5)
            got = await client.kv.get("/k", timeout=5)
            assert got.kvs[0].value == b"v"
            lease = await client.lease.grant(1, timeout=5)
            await client.kv.put("/leased", "x", lease=lease.ID, timeout=5)
            for _ in range(60):  # the TTL is really waited out
                if not (await client.kv.get("/leased", timeout=5)).kvs:
                    break
                await asyncio.sleep(0.1)
            assert not (await client.kv.get("/leased", timeout=5)).kvs
    finally:
        server.stop()
    assert not server.process.is_running()


def test_two_servers_of_each_kind_side_by_side(tmp_path):
    servers = [start_nats(tmp_path / "a"), start_nats(tmp_path / "b"), start_etcd(tmp_path / "c"), start_etcd(tmp_path / "d")]
    try:
        assert len({s.port for s in servers}) == 4
    finally:
        for s in servers:
            s.stop()


def test_a_process_that_exits_early_is_reported(tmp_path):
    process = ManagedProcess("false", ["sh", "-c", "echo going away; exit 3"], log_path=tmp_path / "x.log")
    with pytest.raises(ProcessStartError, match="going away"):
        process.wait_for_line(lambda line: "never" in line, timeout=10)
    assert process.stop() == 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_parent_even_when_the_parent_is_sigkilled(tmp_path):
    """A parent that cannot clean up (SIGKILL) still leaves no child behind."""
    parent_code = (
        "import signal, sys, time\n"
        "from pathlib import Path\n"
        "from kvmesh.infra.processes import ManagedProcess\n"
        f"child = ManagedProcess('child', [sys.executable, '-c', 'import time; time.sleep(60)'], "
        f"log_path=Path({str(tmp_path / 'child.log')!r}), parent_death_signal=signal.SIGTERM)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        assert not process_gone(child_pid)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not process_gone(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_gone(child_pid)
    finally:
        parent.kill()
        parent.wait(10)


def test_stop_all_stops_processes_together_and_kills_the_stubborn(tmp_path):
    slow = [sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.5), sys.exit(0))); print('up', flush=True); time.sleep(60)"]
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"]
    processes = [ManagedProcess(f"slow-{i}", slow, log_path=tmp_path / f"{i}.log") for i in range(4)]
    processes.append(ManagedProcess("stubborn", stubborn, log_path=tmp_path / "s.log"))
    for process in processes:
        process.wait_for_line(lambda line: line == "up", timeout=20)
    began = time.monotonic()
    stop_all(processes, grace=1.5)
    took = time.monotonic() - began
    assert [p.popen.returncode for p in processes] == [0, 0, 0, 0, -signal.SIGKILL]
    assert 1.5 <= took < 1.5 + 1.5  # one grace for all, not four half-seconds and a grace in a row


async def test_nats_and_etcd_come_back_on_the_same_port_with_their_data(tmp_path):
    nats_server = start_nats(tmp_path / "n")
    etcd = start_etcd(tmp_path / "e")
    try:
        url, endpoint = nats_server.url, etcd.endpoint
        async with Etcd3Client([endpoint]) as client:
            await client.kv.put("/kept", "v", timeout=5)
        nats_server.process.kill()
        etcd.process.kill()
        old = (nats_server.process.pid, etcd.process.pid)
        nats_server.respawn()
        etcd.respawn()
        assert (nats_server.process.pid, etcd.process.pid) != old
        assert (nats_server.url, etcd.endpoint) == (url, endpoint)
        nats_server.process.wait_for_line(lambda line: "Server is ready" in line, timeout=20)
        nc = await nats.connect(url, connect_timeout=5)
        await nc.close()
        async with Etcd3Client([endpoint]) as client:
            for _ in range(100):  # until the restarted etcd answers
                try:
                    got = await client.kv.get("/kept", timeout=1)
                    break
                except Exception:  # noqa: BLE001 - not serving yet
                    await asyncio.sleep(0.1)
            assert got.kvs[0].value == b"v"
    finally:
        nats_server.stop()
        etcd.stop()


async def test_etcd_delete_key_revokes_its_lease(tmp_path):
    etcd = start_etcd(tmp_path)
    try:
        async with Etcd3Client([etcd.endpoint]) as client:
            lease = await client.lease.grant(60, timeout=5)
            await client.kv.put("/kvmesh/default/workers/decode/decode-2", "record", lease=lease.ID, timeout=5)
            await client.kv.put("/kvmesh/default/blocks/decode-2/abc", "1", lease=lease.ID, timeout=5)
            await client.kv.put("/kvmesh/default/workers/decode/decode-3", "other", timeout=5)
            assert await asyncio.to_thread(etcd.delete_key, "/kvmesh/default/workers/decode/decode-2")
            for key in ("/kvmesh/default/workers/decode/decode-2", "/kvmesh/default/blocks/decode-2/abc"):
                assert not (await client.kv.get(key, timeout=5)).kvs  # gone now, not in 60 s
            assert (await client.kv.get("/kvmesh/default/workers/decode/decode-3", timeout=5)).kvs
            assert not await asyncio.to_thread(etcd.delete_key, "/kvmesh/default/workers/decode/decode-2")
    finally:
        etcd.stop()
    began = time.monotonic()
    assert not etcd.delete_key("/kvmesh/default/workers/decode/decode-3", timeout=2)  # etcd gone: best effort
    assert time.monotonic() - began < 3
