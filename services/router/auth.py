"""Bearer-token authentication for the router, as ASGI middleware.

``/v1/*`` always needs a key once keys are configured; ``/metrics`` only with ``metrics=True``
(``--auth-metrics``), the API docs (``/docs``, ``/redoc``, ``/openapi.json``) only with
``docs=True`` (``--auth-docs``); ``/health*`` never. The matching key's name is put in the
request's scope (``key_name``) for the rate limiter, the metrics and the log line.
"""

from __future__ import annotations

from collections.abc import Collection, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from kvmesh.services.router.api_keys import ANONYMOUS, ApiKeys
from kvmesh.services.router.metrics import RouterMetrics
from kvmesh.services.router.openai_api import APIError

__all__ = ["KEY_NAME_SCOPE", "BearerAuth", "key_name"]

KEY_NAME_SCOPE = "kvmesh.key_name"
DOCS_PATHS = ("/docs", "/redoc", "/openapi.json")


def key_name(scope: MutableMapping[str, Any]) -> str:
    """The name of the key the request came with (``anonymous`` when keys are off)."""
    return str(scope.get(KEY_NAME_SCOPE, ANONYMOUS))


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


class BearerAuth:
    """ASGI middleware: ``Authorization: Bearer <key>`` with one of ``keys``.

    A rejected request to one of ``counted_paths`` (the generation endpoints) is counted in
    ``metrics`` with status 401.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: ApiKeys,
        metrics: RouterMetrics,
        counted_paths: Collection[str],
        protect_metrics: bool = False,
        protect_docs: bool = False,
    ) -> None:
        self.app = app
        self.keys = keys
        self.metrics = metrics
        self.counted_paths = counted_paths
        self.prefixes = ["/v1", *(["/metrics"] if protect_metrics else []), *(DOCS_PATHS if protect_docs else ())]

    def protects(self, path: str) -> bool:
        if _under(path, "/health"):
            return False
        return any(_under(path, prefix) for prefix in self.prefixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.protects(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("authorization", "")
        scheme, _, token = given.partition(" ")
        name = self.keys.identify(token.strip().encode()) if scheme.lower() == "bearer" else None
        if name is None:
            path = scope["path"]
            if path in self.counted_paths:
                self.metrics.count(path, 401)
            message = (
                "Incorrect API key provided." if given else "Missing API key: use 'Authorization: Bearer <key>'."
            )
            error = APIError(401, message, code="invalid_api_key")
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
            return
        scope[KEY_NAME_SCOPE] = name
        await self.app(scope, receive, send)
