"""The router process: the OpenAI-compatible API in front of the mesh.

SIGTERM or SIGINT ends every open stream with an error event and ``[DONE]``, answers what is
waiting with a 503, and exits within about two seconds (``server``).

API keys come from ``--api-key-file`` / ``KVMESH_API_KEY_FILE`` and ``KVMESH_API_KEY``
(``api_keys``), never from the command line; rate limits from ``--rate-limits`` /
``KVMESH_RATE_LIMITS`` (``rate_limits``), counted in this process or, with
``--rate-limit-store nats``, in a JetStream KV bucket every router shares (``rate_store``).
"""

from __future__ import annotations

import logging

from kvmesh.service_main import start_service
from kvmesh.services.router.app import create_app
from kvmesh.services.router.generation_defaults import GenerationDefaults
from kvmesh.services.router.mesh_backend import MeshBackend
from kvmesh.services.router.rate_store import NatsCounters
from kvmesh.services.router.server import RouterServer, bind, serve
from kvmesh.settings.router import router_settings
from kvmesh.telemetry import shutdown_tracing

logger = logging.getLogger("kvmesh.router")


async def main(argv: list[str] | None = None) -> None:
    settings = router_settings(argv)
    mesh, keys, rate_limits = settings.mesh, settings.api_keys, settings.rate_limit_config
    await start_service("router", settings)
    sock = bind(settings.host, settings.port)  # before anything connects: a bad --host or a taken port fails at once
    logger.info(
        "API keys: %s; rate limits: %s (store: %s)",
        ", ".join(keys.names) if keys else "none (/v1 is open)",
        rate_limits if rate_limits else "none",
        settings.rate_limit_store,
    )
    backend = MeshBackend(
        mesh,
        model=settings.model,
        served_name=settings.served_model_name,
        max_attempts=settings.max_attempts,
        routing_config=settings.routing_config,
        local_prefill_max_tokens=settings.local_prefill_max_tokens,
        kv_query_timeout=settings.kv_query_timeout,
        kv_index=settings.kv_index,
    )
    defaults = GenerationDefaults.load(settings.generation_config, backend.model_dir)
    logger.info("generation defaults: %s", defaults.describe())
    await backend.start()
    shared = settings.rate_limit_store == "nats"
    store = NatsCounters(backend.nc, mesh.namespace) if shared and rate_limits else None
    if store is not None and await store.connect():
        logger.info("rate limits: token budgets shared through the NATS KV bucket %s", store.bucket)
    app = create_app(
        backend,
        api_keys=keys,
        auth_metrics=settings.auth_metrics,
        auth_docs=settings.auth_docs,
        rate_limits=rate_limits,
        rate_store=store,
        shared_rate_store=shared,
        limits=settings.limits,
        cors_allow_origins=settings.cors_allow_origins,
        generation_defaults=defaults,
    )
    try:
        await serve(RouterServer(app, settings.limits), sock)
    finally:
        await backend.close()
        shutdown_tracing()
        logger.info("router stopped")
