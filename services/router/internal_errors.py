"""An exception no handler answered (a bug in the router, met by some input) as an answer.

Starlette answers it with a plain-text 500 and re-raises it, and uvicorn then closes the
connection: the client's next request on it (a keep-alive pool's) fails with a reset, and
the request is missing from the router's request counts. Here it becomes a 500 with an
OpenAI error body, counted like any answer, its traceback logged once, and the connection
stays open. A stream that had begun answering cannot change its status: that is re-raised
(``EventStream`` ends a stream's own failures with an error event before this).
"""

from __future__ import annotations

import logging

from starlette.types import Message, Receive, Scope, Send

from kvmesh.services.router.limits import AnsweringMiddleware
from kvmesh.services.router.openai_api import APIError

__all__ = ["InternalErrors"]

logger = logging.getLogger(__name__)


class InternalErrors(AnsweringMiddleware):
    """ASGI middleware, inside the others: what the app raised, answered with a 500."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            if started:
                raise
            logger.exception("%s %s failed: answered 500", scope["method"], scope["path"])
            await self.answer(scope, send, APIError(500, "the router failed on this request (its log has the traceback)"))
