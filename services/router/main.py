"""The router process: the OpenAI-compatible API in front of the mesh."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys

import uvicorn

from kvmesh.services.router.app import create_app
from kvmesh.services.router.mesh_backend import MeshBackend
from kvmesh.telemetry import setup_tracing, shutdown_tracing
from kvmesh.worker.settings import add_mesh_args, mesh_settings

logger = logging.getLogger("kvmesh.router")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh-router", description="kvmesh router (OpenAI-compatible API)")
    add_mesh_args(parser)
    parser.add_argument("--host", default=os.environ.get("KVMESH_ROUTER_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("KVMESH_ROUTER_PORT", "8000")), help="0 picks a free port")
    parser.add_argument("--model", default=os.environ.get("KVMESH_MODEL"), help="for the tokenizer and chat template")
    parser.add_argument("--served-model-name", default=os.environ.get("KVMESH_SERVED_MODEL_NAME"))
    parser.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY"), help="require this Bearer token on /v1")
    parser.add_argument("--max-attempts", type=int, default=3, help="tries per request")
    parser.add_argument(
        "--routing-config",
        default=os.environ.get("KVMESH_ROUTING_CONFIG"),
        help="JSON or YAML file of scoring plugins and weights (default: prefix x2, load x1, session x1)",
    )
    return parser


async def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv if argv is not None else sys.argv[1:])
    mesh = mesh_settings(args, parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("settings: %s", {k: v for k, v in vars(args).items() if k != "api_key"})
    setup_tracing("kvmesh-router")
    backend = MeshBackend(
        mesh,
        model=args.model,
        served_name=args.served_model_name,
        max_attempts=args.max_attempts,
        routing_config=args.routing_config,
    )
    await backend.start()
    app = create_app(backend, api_key=args.api_key)
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(app, excluded_urls="health,metrics")
    except ImportError:
        logger.info("opentelemetry-instrumentation-fastapi not installed: no HTTP spans")

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    logger.info("router listening on http://%s:%d", args.host, port)
    try:
        await serving
    finally:
        await backend.close()
        shutdown_tracing()
