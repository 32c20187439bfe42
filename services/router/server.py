"""Serving the router's app over HTTP: uvicorn with the router's protocol, and its shutdown.

``RouterServer`` takes SIGTERM and SIGINT over from uvicorn. The first begins the app's
``Shutdown`` (open streams end with an error event and ``[DONE]``, waiting requests get a 503)
and stops the server: it closes its listening socket, lets the connections finish for at most
``GRACE_SECONDS`` and returns. A second signal stops it at once. Unlike uvicorn's own handler it
does not re-raise the signal afterwards, so the caller's cleanup (closing the backend) runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Generator

import uvicorn
from fastapi import FastAPI

from kvmesh.errors import ListenError
from kvmesh.services.router.http_protocol import router_protocol
from kvmesh.services.router.limits import Limits
from kvmesh.services.router.shutdown import Shutdown

__all__ = ["GRACE_SECONDS", "RouterServer", "bind", "serve"]

logger = logging.getLogger(__name__)

GRACE_SECONDS = 1.5  # for connections to finish once shutdown began, before their tasks are cancelled
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (0 picks a free port).

    Made with ``IPPROTO_TCP`` named, not 0: asyncio turns Nagle's algorithm off
    (``TCP_NODELAY``) only on sockets whose ``proto`` says TCP, and the connections accepted
    here take it from this one. With Nagle on, a stream's first chunk, written just after its
    headers, waited for the client's delayed ACK of them: about 40 ms of every streamed
    request's time to first token (docs/benchmarks.md, "Time to first token through the mesh")."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:  # no such host, a port in use: one line at start (``run_service``)
        sock.close()
        raise ListenError(host, port, exc) from None
    return sock


class RouterServer(uvicorn.Server):
    """uvicorn's server for the router's app: its protocol, its limits, its shutdown."""

    def __init__(self, app: FastAPI, limits: Limits, *, log_level: str = "warning") -> None:
        config = uvicorn.Config(
            app,
            http=router_protocol(limits),  # type: ignore[arg-type]
            timeout_graceful_shutdown=GRACE_SECONDS,  # type: ignore[arg-type]
            log_level=log_level,
            access_log=False,
        )
        super().__init__(config)
        self.shutdown_flag: Shutdown = app.state.shutdown

    def begin_shutdown(self, reason: str = "asked to") -> None:
        """End what is in flight and stop serving; call on the event loop's thread."""
        if self.should_exit:
            return
        logger.info("router shutting down (%s): ending %d connection(s)", reason, len(self.server_state.connections))
        self.shutdown_flag.begin()
        self.should_exit = True

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.should_exit:
            logger.info("%s again: stopping now", sig.name)
            self.force_exit = True
            return
        self.begin_shutdown(sig.name)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)


async def serve(server: RouterServer, sock: socket.socket, *, on_listening: str = "router listening on") -> None:
    """Serve on ``sock`` until shut down; logs ``<on_listening> http://host:port`` once accepting."""
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = sock.getsockname()[:2]
        logger.info("%s http://%s:%d", on_listening, f"[{host}]" if ":" in host else host, port)
    await serving
