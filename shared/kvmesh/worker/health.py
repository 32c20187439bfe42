"""A service's liveness and readiness over HTTP, on a port of its own.

``GET /health/live`` answers 200 while the process can do its job at all (for a worker:
the engine thread is alive); ``GET /health/ready`` (and ``/health``) answers 200 only when
it can take work now (engine stepping, NATS and etcd connected, not draining), else 503,
with the failing checks in the JSON body. ``GET /metrics`` answers the service's Prometheus
metrics (``kvmesh.metrics``), when it has any. Kubernetes probes, Prometheus, ``kvmesh up``
and operators read it; it needs no credentials and reads no request body.

A few lines of asyncio instead of a web framework: the service's event loop serves it, so
it answers even while the engine thread is busy with a long step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvmesh.errors import ListenError

logger = logging.getLogger(__name__)

READ_TIMEOUT = 5.0
MAX_REQUEST_LINE = 8192
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus's text format


@dataclass(slots=True)
class HealthStatus:
    live: bool
    ready: bool
    checks: dict[str, bool] = field(default_factory=dict)
    detail: str = ""


class HealthServer:
    def __init__(
        self,
        check: Callable[[], HealthStatus],
        host: str = "127.0.0.1",
        port: int = 0,
        metrics: Callable[[], Awaitable[bytes]] | None = None,
    ) -> None:
        self._check = check
        self.metrics = metrics  # the text of GET /metrics (settable once the service has its metrics)
        self.host = host
        self.port = port
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> str:
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_REQUEST_LINE)
        except OSError as exc:
            raise ListenError(self.host, self.port, exc) from None
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("health checks on %s/health/live and /health/ready", self.url)
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        content_type = "application/json"
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                request_line = await reader.readline()
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # headers: nothing in them matters here
            text = await self._metrics_text(request_line)
            if text is not None:
                status, payload, content_type = 200, text, METRICS_CONTENT_TYPE
            else:
                status, body = self._answer(request_line)
                payload = json.dumps(body).encode()
        except (TimeoutError, asyncio.LimitOverrunError, ValueError, ConnectionError):
            status, payload = 400, json.dumps({"error": "bad request"}).encode()
        head = (
            f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        )
        try:
            writer.write(head.encode() + payload)
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT)
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    async def _metrics_text(self, request_line: bytes) -> bytes | None:
        """The metrics' text for ``GET /metrics`` (empty before the service has metrics);
        ``None`` for any other request."""
        parts = request_line.decode("latin-1").split()
        if len(parts) < 2 or parts[0] not in ("GET", "HEAD") or parts[1].split("?", 1)[0] != "/metrics":
            return None
        if self.metrics is None:
            return b""
        try:
            return await asyncio.wait_for(self.metrics(), READ_TIMEOUT)
        except Exception:  # noqa: BLE001 - a scrape that fails says so in the log, the service goes on
            logger.exception("rendering /metrics failed")
            return b""

    def _answer(self, request_line: bytes) -> tuple[int, dict]:
        parts = request_line.decode("latin-1").split()
        if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
            return 405, {"error": "only GET"}
        path = parts[1].split("?", 1)[0]
        if path not in ("/health", "/health/live", "/health/ready"):
            return 404, {"error": f"no such path {path}"}
        try:
            status = self._check()
        except Exception as exc:  # noqa: BLE001 - a failing check is an unhealthy answer
            logger.exception("health check failed")
            status = HealthStatus(live=False, ready=False, detail=f"health check failed: {exc!r}")
        ok = status.live if path == "/health/live" else status.ready
        body = {"status": "ok" if ok else "unavailable", "live": status.live, "ready": status.ready, "checks": status.checks}
        if status.detail:
            body["detail"] = status.detail
        return (200 if ok else 503), body
