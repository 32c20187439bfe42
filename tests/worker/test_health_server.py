"""The health endpoint: live and ready answered from the service's own checks, over a real
socket, never blocked by a slow or bad client."""

from __future__ import annotations

import asyncio
import json

from kvmesh.worker.health import HealthServer, HealthStatus


async def get(port: int, path: str) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def test_live_and_ready_follow_the_checks():
    status = HealthStatus(live=True, ready=False, checks={"engine": True, "nats": False}, detail="nats failing")
    server = HealthServer(lambda: status)
    await server.start()
    try:
        assert await get(server.port, "/health/live") == (
            200,
            {"status": "ok", "live": True, "ready": False, "checks": {"engine": True, "nats": False}, "detail": "nats failing"},
        )
        code, body = await get(server.port, "/health/ready")
        assert (code, body["status"], body["detail"]) == (503, "unavailable", "nats failing")
        assert (await get(server.port, "/health"))[0] == 503
        status.ready = True
        status.detail = ""
        assert (await get(server.port, "/health/ready"))[0] == 200
        status.live = False
        assert (await get(server.port, "/health/live"))[0] == 503
        assert (await get(server.port, "/nope"))[0] == 404
    finally:
        await server.stop()


async def test_a_failing_check_is_unhealthy_not_a_crash():
    def broken() -> HealthStatus:
        raise RuntimeError("boom")

    server = HealthServer(broken)
    await server.start()
    try:
        code, body = await get(server.port, "/health/ready")
        assert (code, body["live"], body["ready"]) == (503, False, False)
        assert "boom" in body["detail"]
    finally:
        await server.stop()


async def test_a_silent_client_does_not_block_others():
    server = HealthServer(lambda: HealthStatus(live=True, ready=True))
    await server.start()
    try:
        _, idle_writer = await asyncio.open_connection("127.0.0.1", server.port)  # never sends a line
        assert (await asyncio.wait_for(get(server.port, "/health/ready"), 2))[0] == 200
        idle_writer.close()
    finally:
        await server.stop()


async def raw_get(port: int, path: str) -> tuple[int, str, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    content_type = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n") if line.lower().startswith(b"content-type"))
    return int(head.split()[1]), content_type, body


async def test_metrics_are_served_beside_the_checks_and_a_failing_render_is_empty():
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    Counter("kvmesh:things", "things", registry=registry).inc(3)
    server = HealthServer(lambda: HealthStatus(live=True, ready=True))
    await server.start()
    try:
        assert await raw_get(server.port, "/metrics") == (200, "text/plain; version=0.0.4; charset=utf-8", b"")  # none yet

        async def render() -> bytes:
            return generate_latest(registry)

        server.metrics = render
        code, content_type, body = await raw_get(server.port, "/metrics?x=1")
        assert (code, content_type.split(";")[0]) == (200, "text/plain")
        assert b"kvmesh:things_total 3.0" in body

        async def broken() -> bytes:
            raise RuntimeError("no")

        server.metrics = broken
        assert (await raw_get(server.port, "/metrics"))[::2] == (200, b"")
        assert (await get(server.port, "/health/ready"))[0] == 200  # the checks still answer
    finally:
        await server.stop()
