"""Real nats-server and etcd, started on free ports and stopped by PID."""

from __future__ import annotations

import asyncio

import nats
import pytest
from etcd3aio import Etcd3Client

from kvmesh.infra.processes import ManagedProcess, ProcessStartError
from kvmesh.infra.servers import start_etcd, start_nats


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
