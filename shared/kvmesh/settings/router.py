"""The router's settings (``RouterSettings``) from flags and ``KVMESH_*`` variables
(``router_settings``).

API keys come from ``--api-key-file`` / ``KVMESH_API_KEY_FILE`` and ``KVMESH_API_KEY``
(``kvmesh.services.router.api_keys``), never from the command line; rate limits from
``--rate-limits`` / ``KVMESH_RATE_LIMITS`` (``kvmesh.services.router.rate_limits``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import NoReturn

from kvmesh.services.router.generation_defaults import GenerationDefaults
from kvmesh.services.router.api_keys import ApiKeyError, ApiKeys, load_api_keys
from kvmesh.services.router.limits import Limits
from kvmesh.services.router.rate_limits import RateLimitConfig, RateLimitConfigError, load_rate_limits
from kvmesh.services.router.worker_choice import KV_INDEXES, LOCAL_PREFILL_MAX_TOKENS
from kvmesh.settings import env
from kvmesh.settings.flags import SettingsParser, from_args, switch
from kvmesh.settings.values import host_address, non_negative_int, port_number, positive_int, positive_number
from kvmesh.settings.mesh import MeshSettings, add_mesh_args, mesh_settings

NO_KEY_IN_ARGV = "--api-key is gone: a key on the command line is visible to every user (ps); use --api-key-file PATH or KVMESH_API_KEY"
NOT_LOGGED = {"logged": False}  # a field's metadata: left out of the settings logged at start


@dataclass(slots=True, frozen=True)
class RouterSettings:
    mesh: MeshSettings
    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port
    model: str | None = None  # for the tokenizer and chat template
    served_model_name: str | None = None
    api_key_file: str | None = None
    auth_metrics: bool = False  # /metrics needs a key too
    auth_docs: bool = False  # /docs, /redoc and /openapi.json need a key too
    rate_limits: str | None = None  # the file of per-key limits
    rate_limit_store: str = "local"  # where token budgets are counted: local or nats
    cors_allow_origins: tuple[str, ...] = ()
    generation_config: str = "auto"  # auto, vllm or a directory with a generation_config.json
    max_attempts: int = 3  # tries per request
    routing_config: str | None = None  # file of scoring plugins and weights; None: the default
    local_prefill_max_tokens: int = LOCAL_PREFILL_MAX_TOKENS  # conditional disaggregation (``worker_choice``); 0: off
    kv_index: str = "replica"  # which workers hold a prefix: the router's own copy of the index, or ask kv-metadata
    kv_query_timeout: float = 0.05  # seconds for kv-metadata's prefix answer; past it, the request is routed by load
    limits: Limits = field(default_factory=Limits)
    # What the two files above hold, loaded (and checked) at start; never logged.
    api_keys: ApiKeys | None = field(default=None, metadata=NOT_LOGGED)
    rate_limit_config: RateLimitConfig | None = field(default=None, metadata=NOT_LOGGED)


class _NoApiKeyFlag(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {NO_KEY_IN_ARGV}\n")  # one line, no usage


def _origins(value: str) -> tuple[str, ...]:
    return tuple(origin.strip().rstrip("/") for origin in value.split(",") if origin.strip())


def router_parser() -> SettingsParser:
    parser = SettingsParser(prog="kvmesh-router", description="kvmesh router (OpenAI-compatible API)")
    add_mesh_args(parser)
    option = parser.option
    option("--host", env=env.ROUTER_HOST, type=host_address, default="127.0.0.1")
    option("--port", env=env.ROUTER_PORT, type=port_number, default=8000, help="0 picks a free port")
    option("--model", env=env.MODEL, help="for the tokenizer and chat template")
    option("--served-model-name", env=env.SERVED_MODEL_NAME)
    auth = parser.add_argument_group("API keys and rate limits")
    auth.add_argument("--api-key", nargs="?", action=_NoApiKeyFlag, help=argparse.SUPPRESS)
    option(
        "--api-key-file", env=env.API_KEY_FILE, group=auth,
        help="file of API keys, one a line as name:key (a bare key is named default); "
        "KVMESH_API_KEY adds one key named default. Without keys /v1 is open",
    )  # fmt: skip
    option("--auth-metrics", env=env.AUTH_METRICS, group=auth, action="store_true", default=False, from_env=switch, help="/metrics needs a key too")
    option(
        "--auth-docs", env=env.AUTH_DOCS, group=auth, action="store_true", default=False, from_env=switch,
        help="/docs, /redoc and /openapi.json need a key too",
    )  # fmt: skip
    option(
        "--rate-limits", env=env.RATE_LIMITS, group=auth,
        help='JSON or YAML file of per-key limits: {"keys": {name: {...}}, "default": {...}}',
    )  # fmt: skip
    option(
        "--rate-limit-store", env=env.RATE_LIMIT_STORE, group=auth, choices=["local", "nats"], default="local",
        help="where token budgets are counted: this router (local, the default) or a NATS JetStream KV bucket every router shares",
    )  # fmt: skip
    option(
        "--cors-allow-origins", env=env.CORS_ALLOW_ORIGINS, type=_origins, default=(),
        help="comma-separated origins (or *) whose browser pages may call the API (CORS); none: CORS off (default)",
    )  # fmt: skip
    option(
        "--generation-config", env=env.GENERATION_CONFIG, default="auto",
        help="sampling defaults for what a request omits: auto (the model's generation_config.json, the default), "
        "vllm (none: OpenAI's) or a directory holding a generation_config.json",
    )  # fmt: skip
    option("--max-attempts", type=positive_int, default=3, help="tries per request")
    option(
        "--routing-config", env=env.ROUTING_CONFIG,
        help="JSON or YAML file of scoring plugins and weights (default: prefix x2, load x1, session x1)",
    )  # fmt: skip
    option(
        "--local-prefill-max-tokens", env=env.LOCAL_PREFILL_MAX_TOKENS, type=non_negative_int, default=LOCAL_PREFILL_MAX_TOKENS,
        help="a decode worker that holds more of a prompt's prefix than any prefill worker prefills the prompt itself "
        "when at most this many of its tokens are not cached there (a chat's next turn); 0: never (default: %(default)s)",
    )  # fmt: skip
    option(
        "--kv-index", env=env.KV_INDEX, choices=list(KV_INDEXES), default="replica",
        help="where the router learns which workers hold a prompt's prefix: replica (its own copy of the index, kept "
        "from the workers' KV events: no round trip a request; the default) or kv-metadata (asked once a request)",
    )  # fmt: skip
    option(
        "--kv-query-timeout", env=env.KV_QUERY_TIMEOUT, type=positive_number, default=0.05,
        help="seconds the router waits for kv-metadata's answer of which workers hold a prompt's prefix; past it the "
        "request is routed by load alone (default: %(default)s)",
    )  # fmt: skip
    defaults = Limits()
    limits = parser.add_argument_group("request limits")
    option(
        "--max-body-bytes", env=env.MAX_BODY_BYTES, group=limits, type=positive_int, default=defaults.max_body_bytes,
        help="larger request bodies get a 413 (default: %(default)s)",
    )  # fmt: skip
    option(
        "--body-timeout", env=env.BODY_TIMEOUT, group=limits, type=positive_number, default=defaults.body_timeout,
        help="seconds a request body may take to arrive, else a 408 (default: %(default)s)",
    )  # fmt: skip
    option(
        "--max-header-bytes", env=env.MAX_HEADER_BYTES, group=limits, type=positive_int, default=defaults.max_header_bytes,
        help="a larger request line and headers get a 431 (default: %(default)s)",
    )  # fmt: skip
    option(
        "--header-timeout", env=env.HEADER_TIMEOUT, group=limits, type=positive_number, default=defaults.header_timeout,
        help="seconds a request's head may take to arrive, else a 408 (default: %(default)s)",
    )  # fmt: skip
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


def router_settings(argv: list[str] | None = None) -> RouterSettings:
    parser = router_parser()
    args = parser.parse_args(argv)
    mesh = mesh_settings(args, parser)
    limits = limits_from(args, parser)
    keys, rate_limit_config = access_from(args, parser)
    problem = GenerationDefaults.setting_problem(args.generation_config)
    if problem is not None:
        parser.error(problem)
    return from_args(RouterSettings, args, mesh=mesh, limits=limits, api_keys=keys, rate_limit_config=rate_limit_config)
