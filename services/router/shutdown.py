"""The router going away: one flag, set once, that every request in flight watches.

``Shutdown.begin()`` (the signal handler's first act) ends every open SSE stream with an error
event and ``[DONE]``, answers every non-streamed request still waiting with a 503, and refuses
new generation requests; the HTTP server then closes its connections and exits.
"""

from __future__ import annotations

import asyncio

from kvmesh.services.router.openai_api import APIError

__all__ = ["SHUTTING_DOWN", "Shutdown"]

SHUTTING_DOWN = "the server is shutting down"


class Shutdown:
    """Whether the router is shutting down; ``future()`` is done once it is.

    ``begin`` must be called on the event loop's thread (a signal handler installed with
    ``loop.add_signal_handler`` is).
    """

    def __init__(self) -> None:
        self.started = False
        self._future: asyncio.Future[None] | None = None

    def begin(self) -> None:
        self.started = True
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    def future(self) -> asyncio.Future[None]:
        """Done once shutdown began; one future per event loop, shared by every waiter."""
        loop = asyncio.get_running_loop()
        if self._future is None or self._future.get_loop() is not loop:
            self._future = loop.create_future()
            if self.started:
                self._future.set_result(None)
        return self._future

    @staticmethod
    def error() -> APIError:
        return APIError(503, SHUTTING_DOWN, code="unavailable")
