"""Bearer-token authentication for the router's ``/v1/*`` API, as ASGI middleware."""

from __future__ import annotations

import secrets
from collections.abc import Collection

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from kvmesh.services.router.metrics import RouterMetrics
from kvmesh.services.router.openai_api import APIError

__all__ = ["BearerAuth"]


class BearerAuth:
    """ASGI middleware: ``Authorization: Bearer <key>`` on ``/v1/*``.

    A rejected request to one of ``counted_paths`` (the generation endpoints) is counted in
    ``metrics`` with status 401.
    """

    def __init__(
        self, app: ASGIApp, *, api_key: str, metrics: RouterMetrics, counted_paths: Collection[str]
    ) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self.metrics = metrics
        self.counted_paths = counted_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self._expected):
                if path in self.counted_paths:
                    self.metrics.count(path, 401)
                message = (
                    "Incorrect API key provided."
                    if given
                    else "Missing API key: use 'Authorization: Bearer <key>'."
                )
                error = APIError(401, message, code="invalid_api_key")
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
