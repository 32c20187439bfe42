"""The router's app behind its real HTTP server (``RouterServer``), in this process, on port 0."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI

from kvmesh.services.router.limits import Limits
from kvmesh.services.router.server import RouterServer, bind, serve


@dataclass
class Served:
    server: RouterServer
    task: asyncio.Task
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def wait_stopped(self, timeout: float) -> float:
        """Seconds until the server task ended (raises on ``timeout``)."""
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(asyncio.shield(self.task), timeout)
        return asyncio.get_running_loop().time() - started


@contextlib.asynccontextmanager
async def served(app: FastAPI, limits: Limits) -> AsyncIterator[Served]:
    sock = bind("127.0.0.1", 0)
    host, port = sock.getsockname()[:2]
    server = RouterServer(app, limits)
    task = asyncio.create_task(serve(server, sock))
    try:
        while not server.started:
            assert not task.done(), task
            await asyncio.sleep(0.01)
        yield Served(server, task, host, port)
    finally:
        server.should_exit = True
        server.force_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()
