"""The router's HTTP edge: OpenAI-compatible endpoints over a ``GenerationBackend``.

``create_app`` wires the routes; a request's body is read within ``limits``, validated
(``openai_api``; a valid JSON body to completions or chat completions straight from its bytes,
past FastAPI's request handling: ``fast_lane``), tokenized (``prompts``; off the event loop unless the body is small), checked against the model's context,
handed to the backend, and its token events are returned as one JSON object or as server-sent
events (``streaming``). Errors become OpenAI error bodies; metrics go to a registry owned by the
app (``metrics``); ``auth`` guards ``/v1/*`` (and, when asked, ``/metrics`` and the docs) with named
API keys (``api_keys``); ``rate_limit`` admits each request against its key's limits once its
prompt is tokenized; ``app.state.shutdown`` ends what is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from fastapi.telemetry import TelemetryConfig
from opentelemetry.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh import __version__
from kvmesh.services.router.api_docs import (
    CHAT_ANSWER,
    CHAT_CHUNK,
    COMPLETION_ANSWER,
    COMPLETION_CHUNK,
    RESPONSE_ANSWER,
    RESPONSE_EVENT,
    generation_responses,
)
from kvmesh.services.router.api_keys import DEFAULT_NAME, ApiKeys
from kvmesh.services.router.auth import BearerAuth
from kvmesh.services.router.backend import GenerationBackend, HealthReport
from kvmesh.services.router.generation import CHAT_COMPLETIONS, COMPLETIONS, SESSION_HEADER, Generation
from kvmesh.services.router.generation_defaults import GenerationDefaults
from kvmesh.services.router.fast_lane import FastLane, Lane
from kvmesh.services.router.http_spans import HttpSpans
from kvmesh.services.router.internal_errors import InternalErrors
from kvmesh.services.router.limits import BodyLimit, Limits
from kvmesh.services.router.metrics import RouterMetrics
from kvmesh.services.router.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_json,
)
from kvmesh.services.router.prompts import chat_prompt_ids, completion_prompt_ids, resolve_max_tokens
from kvmesh.services.router.rate_limit import RateLimited, RateLimiter
from kvmesh.services.router.rate_limits import RateLimitConfig
from kvmesh.services.router.rate_store import CounterStore
from kvmesh.services.router.responses_api import RESPONSES, ResponsesRequest, chat_request, renamed, responses_answer
from kvmesh.services.router.shutdown import Shutdown
from kvmesh.services.router.streaming import CLIENT_CLOSED

__all__ = [
    "CHAT_COMPLETIONS",
    "COMPLETIONS",
    "SESSION_HEADER",
    "RouterMetrics",
    "chat_prompt_ids",
    "completion_prompt_ids",
    "create_app",
    "resolve_max_tokens",
]

logger = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({COMPLETIONS, CHAT_COMPLETIONS, RESPONSES})
LANE_MODELS = {COMPLETIONS: CompletionRequest, CHAT_COMPLETIONS: ChatCompletionRequest}  # served by ``FastLane``
HEALTH_TIMEOUT = 2.0  # seconds the backend has to answer a health check
TOKENIZER_THREADS = 2
# A request body up to this many bytes is tokenized on the event loop: a hop to the tokenizer
# threads and back cost more than tokenizing it there (about 0.3 ms for 500 characters of chat).
INLINE_TOKENIZE_BYTES = 2048

# FastAPI 0.165+ traces, meters and logs requests itself once a provider is set: all off
NO_FASTAPI_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}
T = TypeVar("T")


# --------------------------------------------------------------------------- errors
class ErrorResponse(Response):
    """An OpenAI error body; encodes whatever the message quotes (``error_json``)."""

    media_type = "application/json"

    def __init__(self, error: APIError) -> None:
        super().__init__(error_json(error.body()), status_code=error.status)


def _error_response(error: APIError) -> Response:
    response = ErrorResponse(error)
    if isinstance(error, RateLimited):
        response.headers.update(error.headers)
    return response


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
        elif not loc and err.get("type") == "missing":  # no body at all
            msg = "the request body is empty: send a JSON object (Content-Type: application/json)"
        field = ".".join(loc)
        params.append(field)
        if err.get("type") == "extra_forbidden":  # a field kvmesh does not implement: named, never ignored
            parts.append(f"unsupported parameter: {field}")
            continue
        parts.append(f"{field}: {msg}" if field else msg)
    return "; ".join(parts) or "invalid request", (params[0] or None) if params else None


class Cors(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered by an OpenAI error body."""

    def __init__(self, app: Any, *, origins: Sequence[str]) -> None:
        super().__init__(
            app,
            allow_origins=list(origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],  # Authorization, Content-Type, x-session-id, what client libraries add
            expose_headers=["Retry-After"],
            max_age=600,
        )

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        error = _error_response(APIError(400, bytes(response.body).decode(), code="cors_refused"))
        error.headers.update({k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")})
        return error


# --------------------------------------------------------------------------- the app
def create_app(
    backend: GenerationBackend,
    *,
    api_keys: ApiKeys | None = None,
    api_key: str | None = None,
    auth_metrics: bool = False,
    auth_docs: bool = False,
    rate_limits: RateLimitConfig | None = None,
    rate_store: CounterStore | None = None,
    shared_rate_store: bool = False,
    clock: Callable[[], float] = time.time,
    limits: Limits | None = None,
    cors_allow_origins: Sequence[str] = (),
    generation_defaults: GenerationDefaults | None = None,
    inline_tokenize_bytes: int = INLINE_TOKENIZE_BYTES,
    tracer_provider: TracerProvider | None = None,
) -> FastAPI:
    """The router's FastAPI app serving ``backend``'s model.

    ``api_keys`` (or one ``api_key``, named ``default``) guard ``/v1/*``, and ``/metrics`` with
    ``auth_metrics``, ``/docs``, ``/redoc`` and ``/openapi.json`` with ``auth_docs``; ``/health*``
    is always open. ``rate_limits`` are enforced per key name (``anonymous`` without keys), with
    counters in ``rate_store`` (default: this process; ``shared_rate_store``: batch output charges)
    and windows by ``clock`` (epoch seconds). ``app.state.shutdown`` is the app's ``Shutdown``:
    the server begins it on SIGTERM / SIGINT. ``cors_allow_origins`` (origins, or ``*``) turns CORS
    on: preflights answered, responses to those origins readable by browsers; off without any.
    ``generation_defaults`` (the model's ``generation_config.json``) fill what a request omits.
    A request whose body declares at most ``inline_tokenize_bytes`` is tokenized on the event
    loop, a larger one in a small thread pool. Each request's span (``HttpSpans``) goes to
    ``tracer_provider``, by default the process's.
    """
    if api_key is not None:
        if api_keys is not None:
            raise ValueError("give api_keys or api_key, not both")
        api_keys = ApiKeys({DEFAULT_NAME: api_key})
    if (auth_metrics or auth_docs) and api_keys is None:
        raise ValueError("auth on /metrics or the docs needs API keys (--api-key-file or KVMESH_API_KEY)")
    limits = limits or Limits()
    defaults = generation_defaults or GenerationDefaults()
    metrics = RouterMetrics(backend.model_name)
    metrics.watch(backend)  # routing decisions and retries
    shutdown = Shutdown()
    limiter = None
    if rate_limits is not None and not rate_limits.empty:
        limiter = RateLimiter(rate_limits, rate_store, clock=clock, on_reject=metrics.reject, shared=shared_rate_store)
    generation = Generation(backend, metrics, shutdown, limiter)
    created = int(time.time())
    tokenizing = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kvmesh-tokenize")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            tokenizing.shutdown(wait=False, cancel_futures=True)

    # the router makes its own HTTP spans (``HttpSpans``): FastAPI's would be a second set
    app = FastAPI(title="kvmesh router", lifespan=lifespan, telemetry=NO_FASTAPI_TELEMETRY)
    app.state.backend = backend
    app.state.metrics = metrics
    app.state.shutdown = shutdown
    app.state.limits = limits
    app.state.rate_limiter = limiter
    lanes: dict[str, Lane] = {}  # the routes below whose valid JSON requests skip FastAPI's handling
    app.add_middleware(FastLane, lanes=lanes, on_error=lambda request, error: rejected(request, error))
    # inside the others: what a handler raised and nothing answered becomes a 500 with an error body
    app.add_middleware(InternalErrors, metrics=metrics, counted_paths=GENERATION_PATHS)
    if api_keys is not None:
        app.add_middleware(
            BearerAuth,
            keys=api_keys,
            metrics=metrics,
            counted_paths=GENERATION_PATHS,
            protect_metrics=auth_metrics,
            protect_docs=auth_docs,
        )
    # outermost: a body is bounded before anything reads it
    app.add_middleware(BodyLimit, limits=limits, metrics=metrics, counted_paths=GENERATION_PATHS)
    if cors_allow_origins:  # outside even that: every answer, errors too, carries its CORS headers
        app.add_middleware(Cors, origins=cors_allow_origins)
    app.add_middleware(HttpSpans, tracer_provider=tracer_provider)  # around all of it: a request's span sees every answer

    async def tokenized(request: Request, work: Callable[..., T], *args: Any) -> T:
        """Tokenizing and templating: on the loop for a small body, else in the app's small
        thread pool (a long prompt would hold the loop and every stream on it)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) <= inline_tokenize_bytes:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(tokenizing, functools.partial(work, *args))

    def rejected(request: Request, error: APIError) -> Response:
        if request.url.path in GENERATION_PATHS:
            metrics.count(request.url.path, error.status)
        if error.status != CLIENT_CLOSED:
            logger.info(
                "%s %s rejected: %d %s", request.method, request.url.path, error.status, error.message
            )
        return _error_response(error)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return rejected(request, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return rejected(request, APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:  # OpenAI's words for a path it does not serve
            return rejected(request, APIError(404, f"Invalid URL ({request.method} {request.url.path})", code="not_found"))
        if exc.status_code == 405:
            return rejected(
                request,
                APIError(405, f"Method not allowed ({request.method} {request.url.path})", code="method_not_allowed"),
            )
        return rejected(request, APIError(exc.status_code, str(exc.detail)))

    def check_accepting(model: str) -> None:
        """A generation request may start: the router is not shutting down, the model is ours."""
        if shutdown.started:
            raise shutdown.error()
        check_model(model)

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

    async def readiness() -> Response:
        if shutdown.started:
            return _error_response(shutdown.error())
        try:
            report: HealthReport = await asyncio.wait_for(backend.health(), HEALTH_TIMEOUT)
        except Exception as exc:
            timed_out = isinstance(exc, asyncio.TimeoutError)
            reason = f"no answer in {HEALTH_TIMEOUT:g} s" if timed_out else str(exc) or type(exc).__name__
            logger.warning("health check failed: %s", reason)
            return _error_response(APIError(503, f"health check failed: {reason}", code="unavailable"))
        if not report.ready:
            return _error_response(APIError(503, report.detail or "not ready", code="unavailable"))
        return JSONResponse({"status": "ok", "workers": report.workers})

    app.add_api_route("/health", readiness, methods=["GET"])
    app.add_api_route("/health/ready", readiness, methods=["GET"])

    @app.get("/health/live")
    async def liveness() -> JSONResponse:
        return JSONResponse({"status": "alive"})

    @app.get("/metrics", response_class=PlainTextResponse)  # Prometheus' text format
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> JSONResponse:
        check_model(model)
        return JSONResponse(model_card())

    @app.post(COMPLETIONS, responses=generation_responses(COMPLETION_ANSWER, COMPLETION_CHUNK))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_accepting(body.model)
        prompts = await tokenized(request, completion_prompt_ids, body, backend.tokenizer, backend.max_model_len)
        body = defaults.apply(body, [len(ids) for ids in prompts], backend.max_model_len)
        return await generation.serve(request, COMPLETIONS, body, prompts)

    @app.post(CHAT_COMPLETIONS, responses=generation_responses(CHAT_ANSWER, CHAT_CHUNK))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_accepting(body.model)
        prompt_ids = await tokenized(request, chat_prompt_ids, body, backend.tokenizer, backend.max_model_len)
        body = defaults.apply(body, [len(prompt_ids)], backend.max_model_len)
        return await generation.serve(request, CHAT_COMPLETIONS, body, [prompt_ids])

    @app.post(RESPONSES, responses=generation_responses(RESPONSE_ANSWER, RESPONSE_EVENT, done=False))
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API, served by the chat path (``responses_api``)."""
        check_accepting(body.model)
        chat = chat_request(body, await request.json())
        try:
            prompt_ids = await tokenized(request, chat_prompt_ids, chat, backend.tokenizer, backend.max_model_len)
            chat = defaults.apply(chat, [len(prompt_ids)], backend.max_model_len)
            answer = await generation.serve(request, RESPONSES, chat, [prompt_ids])
        except APIError as exc:
            renamed(exc)  # the chat path's field names, as this request spells them
            raise
        return responses_answer(answer, body, chat)

    for route in app.routes:
        if isinstance(route, APIRoute) and route.path in LANE_MODELS and "POST" in (route.methods or ()):
            lanes[route.path] = Lane(LANE_MODELS[route.path], route.endpoint, route)
    return app
