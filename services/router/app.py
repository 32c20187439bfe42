"""The router's HTTP edge: OpenAI-compatible endpoints over a ``GenerationBackend``.

``create_app`` wires the routes; a request is validated (``openai_api``), tokenized, checked
against the model's context, handed to the backend, and its token events are returned as one
JSON object or as server-sent events. Errors become OpenAI error bodies; metrics go to a
registry owned by the app.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvmesh.engine.tokenizer import ChatTemplateError, Tokenizer
from kvmesh.errors import MeshError
from kvmesh.protocol import MeshErrorCode, TokenEvent
from kvmesh.services.router.backend import GenerationBackend
from kvmesh.services.router.openai_api import (
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
    Usage,
    sse_event,
)

__all__ = [
    "CHAT_COMPLETIONS",
    "COMPLETIONS",
    "RouterMetrics",
    "chat_prompt_ids",
    "completion_prompt_ids",
    "create_app",
    "resolve_max_tokens",
]

logger = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
GENERATION_PATHS = frozenset({COMPLETIONS, CHAT_COMPLETIONS})
CLIENT_CLOSED = 499  # nginx's "client closed request"; also MeshErrorCode.STATUS["cancelled"]

T = TypeVar("T")


# --------------------------------------------------------------------------- metrics
class RouterMetrics:
    """The router's Prometheus metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvmesh_router_requests",
            "Generation requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvmesh_router_prompt_tokens", "Prompt tokens sent to the mesh", registry=r
        )
        self.generation_tokens = Counter("kvmesh_router_generation_tokens", "Tokens generated", registry=r)
        self.cached_prompt_tokens = Counter(
            "kvmesh_router_cached_prompt_tokens", "Prompt tokens served from the KV cache", registry=r
        )
        self.time_to_first_token = Histogram(
            "kvmesh_router_time_to_first_token_seconds",
            "From the request reaching the backend to its first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "kvmesh_router_inter_token_latency_seconds",
            "Between two consecutive token events of a request",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.e2e_latency = Histogram(
            "kvmesh_router_e2e_request_latency_seconds",
            "From the request reaching the backend to its last token, successful requests",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
            registry=r,
        )
        self.in_flight = Gauge("kvmesh_router_requests_in_flight", "Requests being generated", registry=r)

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RequestTracker:
    """One request from the backend call to its end: metrics, usage and the log line."""

    def __init__(self, metrics: RouterMetrics, endpoint: str, request_id: str, prompt_tokens: int) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.output_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self._start = time.perf_counter()
        self._last_token_at: float | None = None
        self._done = False
        metrics.in_flight.inc()

    def on_event(self, event: TokenEvent) -> None:
        if event.token_ids:
            now = time.perf_counter()
            if self._last_token_at is None:
                self.metrics.time_to_first_token.observe(now - self._start)
            else:
                self.metrics.inter_token_latency.observe(now - self._last_token_at)
            self._last_token_at = now
            self.output_tokens += len(event.token_ids)
        if event.finished:
            self.finish_reason = event.finish_reason
            self.cached_tokens = event.num_cached_tokens

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.output_tokens, self.cached_tokens)

    def finish(self, status: int) -> None:
        """Record the outcome once (the request counter is the caller's, see ``RouterMetrics.count``)."""
        if self._done:
            return
        self._done = True
        seconds = time.perf_counter() - self._start
        m = self.metrics
        m.in_flight.dec()
        m.prompt_tokens.inc(self.prompt_tokens)
        m.generation_tokens.inc(self.output_tokens)
        m.cached_prompt_tokens.inc(self.cached_tokens)
        if status == 200:
            m.e2e_latency.observe(seconds)
        logger.info(
            "request %s %s status=%d prompt_tokens=%d cached_tokens=%d output_tokens=%d finish_reason=%s seconds=%.3f",
            self.request_id,
            self.endpoint,
            status,
            self.prompt_tokens,
            self.cached_tokens,
            self.output_tokens,
            self.finish_reason,
            seconds,
        )


# --------------------------------------------------------------------------- prompts
def completion_prompt_ids(request: CompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids: a string is encoded with special tokens, ids are range-checked."""
    if isinstance(request.prompt, str):
        ids = tokenizer.encode(request.prompt, add_special_tokens=True)
    else:
        ids = list(request.prompt)
        vocab = tokenizer.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise APIError(
                400, f"prompt token id {bad} is out of range for a vocabulary of {vocab}", param="prompt"
            )
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def chat_prompt_ids(request: ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """The messages rendered by the model's chat template, then encoded without extra specials."""
    try:
        text = tokenizer.apply_chat_template(request.template_messages(), add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "the prompt is empty", param="messages")
    return ids


def resolve_max_tokens(prompt_tokens: int, requested: int | None, max_model_len: int, *, param: str) -> int:
    """The completion budget: as requested if prompt and completion fit, else the rest of the context."""
    if requested is None:
        if prompt_tokens >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{prompt_tokens} tokens, which leaves no room for the completion. Please reduce the length "
                "of the prompt.",
                param=param,
                code="context_length_exceeded",
            )
        return max_model_len - prompt_tokens
    if prompt_tokens + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} in the completion). "
            "Please reduce the length of the prompt or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


# --------------------------------------------------------------------------- helpers
class _ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


def _check_event(event: TokenEvent | None) -> TokenEvent:
    if event is None:
        raise MeshError("internal", "the token stream ended before the request finished")
    if event.error is not None:
        raise MeshError(event.error.code, event.error.message)
    return event


def _as_api_error(exc: BaseException, request_id: str) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, MeshError):
        return APIError(MeshErrorCode.STATUS.get(exc.code, 500), exc.message, code=exc.code)
    if isinstance(exc, _ClientGone):
        return APIError(CLIENT_CLOSED, "the client closed the request", code="cancelled")
    logger.error("request %s failed", request_id, exc_info=exc)
    return APIError(500, "internal error in the router", code="internal")


def _failed(tracker: _RequestTracker, exc: BaseException) -> APIError | None:
    """Record a request that ended in ``exc``: the error to answer with, or None to re-raise ``exc``."""
    if not isinstance(exc, Exception):  # cancelled: the client or the server went away
        tracker.finish(CLIENT_CLOSED)
        return None
    error = _as_api_error(exc, tracker.request_id)
    tracker.finish(error.status)
    return error


async def _aclose(events: AsyncIterator[Any]) -> None:
    """Close a backend iterator (which cancels its request if unfinished), shielded from cancellation."""
    aclose = getattr(events, "aclose", None)
    if aclose is None:
        return
    with anyio.CancelScope(shield=True):
        await aclose()


async def _anext_or_none(events: AsyncIterator[TokenEvent]) -> TokenEvent | None:
    return await anext(events, None)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it and raise ``_ClientGone`` if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise _ClientGone()
    return task.result()


class _EventStream:
    """One streamed answer: its SSE chunks, and a cleanup that runs once however the stream ends."""

    def __init__(
        self,
        events: AsyncIterator[TokenEvent],
        first: TokenEvent,
        fmt: CompletionFormat | ChatFormat,
        tracker: _RequestTracker,
    ) -> None:
        self._events = events
        self._first = first
        self._fmt = fmt
        self._tracker = tracker
        self.status = CLIENT_CLOSED  # unless the stream runs to its end
        self._closed = False
        self._pending: asyncio.Future[TokenEvent | None] | None = None

    async def chunks(self) -> AsyncGenerator[str, None]:
        fmt, tracker = self._fmt, self._tracker
        try:
            for chunk in fmt.opening_chunks():
                yield sse_event(chunk)
            event = self._first
            while True:
                tracker.on_event(event)
                if event.text:
                    yield sse_event(fmt.content_chunk(event.text))
                if event.finished:
                    break
                event = _check_event(await self._next_event())
            yield sse_event(fmt.final_chunk(tracker.finish_reason))
            if fmt.include_usage:
                yield sse_event(fmt.usage_chunk(tracker.usage()))
            self.status = 200
            yield SSE_DONE
        except Exception as exc:
            error = _as_api_error(exc, tracker.request_id)
            self.status = error.status
            yield sse_event(error.body())
            yield SSE_DONE
        finally:
            await self.close()

    async def _next_event(self) -> TokenEvent | None:
        """The backend's next event, fetched in a task of its own.

        Starlette stops a stream whose client left by cancelling an anyio scope, which re-cancels
        every later await in that scope; were the backend iterated here, its cleanup (telling the
        mesh to cancel) could not await anything. ``close`` cancels this task instead, once.
        """
        self._pending = asyncio.ensure_future(_anext_or_none(self._events))
        return await asyncio.shield(self._pending)

    async def close(self) -> None:
        """Close the backend iterator (cancelling an unfinished request) and record the outcome."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._pending is not None and not self._pending.done():
                self._pending.cancel()
                await asyncio.wait([self._pending])
        await _aclose(self._events)
        self._tracker.finish(self.status)
        self._tracker.metrics.count(self._tracker.endpoint, self.status)


class _EventStreamResponse(StreamingResponse):
    """SSE whose stream is closed however the response ends: completed, failed or client gone."""

    media_type = "text/event-stream"

    def __init__(self, stream: _EventStream) -> None:
        self._chunks = stream.chunks()
        self._stream = stream
        super().__init__(self._chunks, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._chunks.aclose()
                await self._stream.close()


class _BearerAuth:
    """ASGI middleware: ``Authorization: Bearer <key>`` on ``/v1/*``."""

    def __init__(self, app: ASGIApp, *, api_key: str, metrics: RouterMetrics) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self._expected):
                if path in GENERATION_PATHS:
                    self.metrics.count(path, 401)
                message = (
                    "Incorrect API key provided."
                    if given
                    else "Missing API key: use 'Authorization: Bearer <key>'."
                )
                await _error_response(APIError(401, message, code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message naming the bad fields, and the first bad field as ``param``."""
    parts: list[str] = []
    params: list[str] = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return (
                f"Invalid JSON in the request body: {err.get('ctx', {}).get('error', err.get('msg'))}",
                None,
            )
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if not loc and isinstance(err.get("input"), (bytes, str)):
            msg = "the request body must be a JSON object (Content-Type: application/json)"
        field = ".".join(loc)
        params.append(field)
        parts.append(f"{field}: {msg}" if field else msg)
    return "; ".join(parts) or "invalid request", (params[0] or None) if params else None


# --------------------------------------------------------------------------- generation
class _Generation:
    """Runs one validated request against the backend and shapes its answer."""

    def __init__(self, backend: GenerationBackend, metrics: RouterMetrics) -> None:
        self.backend = backend
        self.metrics = metrics

    async def serve(
        self,
        request: Request,
        endpoint: str,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
    ) -> Response:
        param = "prompt" if endpoint == COMPLETIONS else "messages"
        max_tokens = resolve_max_tokens(
            len(prompt_ids), body.requested_max_tokens, self.backend.max_model_len, param=param
        )
        request_id = uuid.uuid4().hex
        fmt_cls = CompletionFormat if endpoint == COMPLETIONS else ChatFormat
        fmt = fmt_cls(request_id, self.backend.model_name, include_usage=body.include_usage)
        try:
            events = self.backend.generate(request_id, prompt_ids, body.sampling_spec(max_tokens))
        except Exception as exc:
            raise _as_api_error(exc, request_id) from exc
        tracker = _RequestTracker(self.metrics, endpoint, request_id, len(prompt_ids))
        if body.stream:
            return await self._stream(events, fmt, tracker)
        return await self._complete(request, events, fmt, tracker)

    async def _complete(
        self,
        request: Request,
        events: AsyncIterator[TokenEvent],
        fmt: CompletionFormat | ChatFormat,
        tracker: _RequestTracker,
    ) -> Response:
        try:
            text = await _unless_disconnected(request, self._collect(events, tracker))
        except BaseException as exc:
            error = _failed(tracker, exc)
            if error is None:
                raise
            raise error from exc
        tracker.finish(200)
        self.metrics.count(tracker.endpoint, 200)
        return JSONResponse(fmt.response(text, tracker.finish_reason, tracker.usage()))

    @staticmethod
    async def _collect(events: AsyncIterator[TokenEvent], tracker: _RequestTracker) -> str:
        texts: list[str] = []
        try:
            while True:
                event = _check_event(await anext(events, None))
                tracker.on_event(event)
                texts.append(event.text)
                if event.finished:
                    return "".join(texts)
        finally:
            await _aclose(events)

    async def _stream(
        self, events: AsyncIterator[TokenEvent], fmt: CompletionFormat | ChatFormat, tracker: _RequestTracker
    ) -> Response:
        try:
            first = _check_event(await anext(events, None))
        except BaseException as exc:
            await _aclose(events)
            error = _failed(tracker, exc)
            if error is None:
                raise
            raise error from exc
        return _EventStreamResponse(_EventStream(events, first, fmt, tracker))


# --------------------------------------------------------------------------- the app
def create_app(backend: GenerationBackend, *, api_key: str | None = None) -> FastAPI:
    """The router's FastAPI app serving ``backend``'s model; ``api_key`` guards ``/v1/*``."""
    metrics = RouterMetrics()
    generation = _Generation(backend, metrics)
    created = int(time.time())
    app = FastAPI(title="kvmesh router")
    app.state.backend = backend
    app.state.metrics = metrics
    if api_key is not None:
        app.add_middleware(_BearerAuth, api_key=api_key, metrics=metrics)

    def rejected(request: Request, error: APIError) -> JSONResponse:
        if request.url.path in GENERATION_PATHS:
            metrics.count(request.url.path, error.status)
        if error.status != CLIENT_CLOSED:
            logger.info(
                "%s %s rejected: %d %s", request.method, request.url.path, error.status, error.message
            )
        return _error_response(error)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return rejected(request, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return rejected(request, APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return rejected(request, APIError(exc.status_code, str(exc.detail)))

    def check_model(model: str) -> None:
        if model != backend.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{backend.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def model_card() -> dict[str, Any]:
        return {
            "id": backend.model_name,
            "object": "model",
            "created": created,
            "owned_by": "kvmesh",
            "max_model_len": backend.max_model_len,
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            workers = await backend.health()
        except Exception as exc:
            logger.warning("health check failed: %s", exc)
            return _error_response(APIError(503, f"health check failed: {exc}", code="unavailable"))
        if workers.get("decode", 0) < 1:
            counts = ", ".join(f"{role}={n}" for role, n in sorted(workers.items())) or "none"
            return _error_response(
                APIError(503, f"no decode worker is alive (workers: {counts})", code="unavailable")
            )
        return JSONResponse({"status": "ok", "workers": workers})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> JSONResponse:
        check_model(model)
        return JSONResponse(model_card())

    @app.post(COMPLETIONS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        prompt_ids = completion_prompt_ids(body, backend.tokenizer)
        return await generation.serve(request, COMPLETIONS, body, prompt_ids)

    @app.post(CHAT_COMPLETIONS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        prompt_ids = chat_prompt_ids(body, backend.tokenizer)
        return await generation.serve(request, CHAT_COMPLETIONS, body, prompt_ids)

    return app
