"""The router process: the OpenAI-compatible API in front of the mesh.

SIGTERM or SIGINT ends every open stream with an error event and ``[DONE]``, answers what is
waiting with a 503, and exits within about two seconds (``server``).

API keys come from ``--api-key-file`` / ``KVMESH_API_KEY_FILE`` and ``KVMESH_API_KEY``
(``api_keys``), never from the command line; rate limits from ``--rate-limits`` /
``KVMESH_RATE_LIMITS`` (``rate_limits``), counted in this process or, with
``--rate-limit-store nats``, in a JetStream KV bucket every router shares (``rate_store``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from kvmesh.services.router.api_keys import ApiKeyError, ApiKeys, load_api_keys
from kvmesh.services.router.app import create_app
from kvmesh.services.router.generation_defaults import GenerationDefaults
from kvmesh.services.router.limits import Limits
from kvmesh.services.router.mesh_backend import MeshBackend
from kvmesh.services.router.rate_limits import RateLimitConfig, RateLimitConfigError, load_rate_limits
from kvmesh.services.router.rate_store import NatsCounters
from kvmesh.services.router.server import RouterServer, bind, serve
from kvmesh.telemetry import setup_tracing, shutdown_tracing
from kvmesh.worker.settings import add_mesh_args, mesh_settings

logger = logging.getLogger("kvmesh.router")

NO_KEY_IN_ARGV = "--api-key is gone: a key on the command line is visible to every user (ps); use --api-key-file PATH or KVMESH_API_KEY"


class _NoApiKeyFlag(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {NO_KEY_IN_ARGV}\n")  # one line, no usage


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _origins(value: str) -> tuple[str, ...]:
    return tuple(origin.strip().rstrip("/") for origin in value.split(",") if origin.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh-router", description="kvmesh router (OpenAI-compatible API)")
    add_mesh_args(parser)
    parser.add_argument("--host", default=os.environ.get("KVMESH_ROUTER_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("KVMESH_ROUTER_PORT", "8000")), help="0 picks a free port")
    parser.add_argument("--model", default=os.environ.get("KVMESH_MODEL"), help="for the tokenizer and chat template")
    parser.add_argument("--served-model-name", default=os.environ.get("KVMESH_SERVED_MODEL_NAME"))
    auth = parser.add_argument_group("API keys and rate limits")
    auth.add_argument("--api-key", nargs="?", action=_NoApiKeyFlag, help=argparse.SUPPRESS)
    auth.add_argument(
        "--api-key-file",
        default=os.environ.get("KVMESH_API_KEY_FILE"),
        help="file of API keys, one a line as name:key (a bare key is named default); "
        "KVMESH_API_KEY adds one key named default. Without keys /v1 is open",
    )
    auth.add_argument("--auth-metrics", action="store_true", default=_flag("KVMESH_AUTH_METRICS"), help="/metrics needs a key too")
    auth.add_argument(
        "--auth-docs", action="store_true", default=_flag("KVMESH_AUTH_DOCS"), help="/docs, /redoc and /openapi.json need a key too"
    )
    auth.add_argument(
        "--rate-limits",
        default=os.environ.get("KVMESH_RATE_LIMITS"),
        help='JSON or YAML file of per-key limits: {"keys": {name: {...}}, "default": {...}}',
    )
    auth.add_argument(
        "--rate-limit-store",
        choices=["local", "nats"],
        default=os.environ.get("KVMESH_RATE_LIMIT_STORE", "local"),
        help="where token budgets are counted: this router (local, the default) or a NATS JetStream KV bucket every router shares",
    )
    parser.add_argument(
        "--cors-allow-origins",
        type=_origins,
        default=_origins(os.environ.get("KVMESH_CORS_ALLOW_ORIGINS", "")),
        help="comma-separated origins (or *) whose browser pages may call the API (CORS); none: CORS off (default)",
    )
    parser.add_argument(
        "--generation-config",
        default=os.environ.get("KVMESH_GENERATION_CONFIG", "auto"),
        help="sampling defaults for what a request omits: auto (the model's generation_config.json, the default), "
        "vllm (none: OpenAI's) or a directory holding a generation_config.json",
    )
    parser.add_argument("--max-attempts", type=int, default=3, help="tries per request")
    parser.add_argument(
        "--routing-config",
        default=os.environ.get("KVMESH_ROUTING_CONFIG"),
        help="JSON or YAML file of scoring plugins and weights (default: prefix x2, load x1, session x1)",
    )
    defaults = Limits()
    env = os.environ.get
    limits = parser.add_argument_group("request limits")
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=int(env("KVMESH_MAX_BODY_BYTES", defaults.max_body_bytes)),
        help="larger request bodies get a 413 (default: %(default)s)",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        default=float(env("KVMESH_BODY_TIMEOUT", defaults.body_timeout)),
        help="seconds a request body may take to arrive, else a 408 (default: %(default)s)",
    )
    limits.add_argument(
        "--max-header-bytes",
        type=int,
        default=int(env("KVMESH_MAX_HEADER_BYTES", defaults.max_header_bytes)),
        help="a larger request line and headers get a 431 (default: %(default)s)",
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=float(env("KVMESH_HEADER_TIMEOUT", defaults.header_timeout)),
        help="seconds a request's head may take to arrive, else a 408 (default: %(default)s)",
    )
    return parser


def access_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[ApiKeys | None, RateLimitConfig | None]:
    try:
        keys = load_api_keys(args.api_key_file)
        rate_limits = load_rate_limits(args.rate_limits) if args.rate_limits else None
    except (ApiKeyError, RateLimitConfigError) as exc:
        parser.error(str(exc))
    if (args.auth_metrics or args.auth_docs) and keys is None:
        parser.error("--auth-metrics / --auth-docs need API keys: give --api-key-file or KVMESH_API_KEY")
    return keys, rate_limits


def limits_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Limits:
    try:
        return Limits(
            max_body_bytes=args.max_body_bytes,
            body_timeout=args.body_timeout,
            max_header_bytes=args.max_header_bytes,
            header_timeout=args.header_timeout,
        )
    except ValueError as exc:
        parser.error(str(exc))


async def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv if argv is not None else sys.argv[1:])
    mesh = mesh_settings(args, parser)
    limits = limits_from(args, parser)
    keys, rate_limits = access_from(args, parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("settings: %s", {k: v for k, v in vars(args).items() if k != "api_key"})
    logger.info(
        "API keys: %s; rate limits: %s (store: %s)",
        ", ".join(keys.names) if keys else "none (/v1 is open)",
        rate_limits if rate_limits else "none",
        args.rate_limit_store,
    )
    setup_tracing("kvmesh-router")
    backend = MeshBackend(
        mesh,
        model=args.model,
        served_name=args.served_model_name,
        max_attempts=args.max_attempts,
        routing_config=args.routing_config,
    )
    defaults = GenerationDefaults.load(args.generation_config, backend.model_dir)
    logger.info("generation defaults: %s", defaults.describe())
    await backend.start()
    shared = args.rate_limit_store == "nats"
    store = NatsCounters(backend.nc, mesh.namespace) if shared and rate_limits else None
    if store is not None and await store.connect():
        logger.info("rate limits: token budgets shared through the NATS KV bucket %s", store.bucket)
    app = create_app(
        backend,
        api_keys=keys,
        auth_metrics=args.auth_metrics,
        auth_docs=args.auth_docs,
        rate_limits=rate_limits,
        rate_store=store,
        shared_rate_store=shared,
        limits=limits,
        cors_allow_origins=args.cors_allow_origins,
        generation_defaults=defaults,
    )
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(app, excluded_urls="health,metrics")
    except ImportError:
        logger.info("opentelemetry-instrumentation-fastapi not installed: no HTTP spans")

    sock = bind(args.host, args.port)
    try:
        await serve(RouterServer(app, limits), sock)
    finally:
        await backend.close()
        shutdown_tracing()
        logger.info("router stopped")
