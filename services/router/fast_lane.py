"""The generation endpoints' valid JSON requests, served without FastAPI's request handling.

FastAPI's route for a POST body matches the path against every route, parses the content type
with ``email.message``, decodes the JSON into Python objects, validates those, and enters two
exit stacks, an exception wrapper and its dependency solver before the handler runs: about a
third of a millisecond of a stream's first token after an idle moment on an AVX2-only Zen 3
(``benchmarks/router_http_bench.py``, docs/benchmarks.md "The router's fast lane"). Here a
``POST`` to one of the lanes' paths with a JSON body is validated straight from its bytes
(pydantic's own JSON parser) and handed to the same handler, with the same error answers
(``on_error``). Whatever the lane does not take (another method or path, another content type, a
body that does not validate) goes on to the app unchanged, its body replayed: FastAPI's own
answer to a bad request (the 400 naming the bad fields) stays the one the client gets.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from kvmesh.services.router.limits import replayed
from kvmesh.services.router.openai_api import APIError

__all__ = ["FastLane", "Lane"]


@dataclass(frozen=True, slots=True)
class Lane:
    """One path's handler: ``endpoint(body, request)`` with ``body`` a ``model``."""

    model: type[BaseModel]
    endpoint: Callable[[Any, Request], Awaitable[Response]]
    route: Any  # the app's own route for the path: what the request's span is named after


def _is_json(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


class FastLane:
    """ASGI middleware, the innermost: a lane's valid requests served here, the rest passed on.

    ``lanes`` maps a path to its ``Lane``; it may be filled after the app is made (the handlers
    are the app's own). ``on_error`` answers a handler's ``APIError`` as the app's exception
    handler does."""

    def __init__(self, app: ASGIApp, *, lanes: dict[str, Lane], on_error: Callable[[Request, APIError], Response]) -> None:
        self.app = app
        self.lanes = lanes
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lane = self.lanes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if lane is None or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        first = await receive()  # the whole body (``BodyLimit`` has read it) or the client's leaving
        if first["type"] != "http.request" or first.get("more_body", False):
            await self.app(scope, replayed(first, receive), send)
            return
        request = Request(scope, receive, send)
        try:
            try:
                body = lane.model.model_validate_json(first.get("body", b""))
            except ValidationError:  # FastAPI's answer names the bad fields
                await self.app(scope, replayed(first, receive), send)
                return
            scope["route"] = lane.route
            response = await lane.endpoint(body, request)
        except APIError as exc:  # the handler's, or a validator's own answer
            response = self.on_error(request, exc)
        await response(scope, receive, send)
