"""Every ``KVMESH_*`` environment variable kvmesh reads, in one registry, and the one typed
reader of them.

A variable is declared here once, with what reads it and what it means; the settings
modules (``kvmesh.settings.mesh``, ``.worker``, ``.router``, ``.kv_metadata``) give each
its flag, where it has one. Tests list the registry against the deployment files and
against every ``KVMESH_*`` name in the code, so a new variable cannot bypass it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

ROUTER = "router"
PREFILL = "prefill-worker"
DECODE = "decode-worker"
KV_METADATA = "kv-metadata"
WORKERS = (PREFILL, DECODE)
SERVICES = (ROUTER, PREFILL, DECODE, KV_METADATA)
UP = "kvmesh up"  # the local launcher
ETCD_AUTH = "kvmesh etcd-auth"
COMPOSE = "docker compose"  # read by the compose file itself, never by a process
TESTS = "the test suite"  # tests/, through kvmesh.testing


class EnvError(ValueError):
    """A variable whose value cannot be read as its type; the message names it."""


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    type: type  # what its text is read as (bool: a flag that is on or off)
    readers: tuple[str, ...]  # the services and tools that read it
    help: str
    internal: bool = False  # set by kvmesh for a process of its own; never a deployment's

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """Its text, or None where it is not set."""
        return (os.environ if environ is None else environ).get(self.name)

    def read(self, convert: Callable[[str], T], default: T, environ: Mapping[str, str] | None = None) -> T:
        """Its value as ``convert`` reads its text, ``default`` where it is not set; a value
        ``convert`` refuses raises ``EnvError`` naming the variable."""
        text = self.raw(environ)
        if text is None:
            return default
        try:
            return convert(text)
        except (TypeError, ValueError) as exc:
            raise EnvError(f"{self.name}={text!r}: {why(exc, convert, text)}") from None


def why(exc: Exception, convert: Callable[[str], object], text: str) -> str:
    """What is wrong with ``text``, in ``kvmesh.settings.values``' words."""
    if convert is int:  # int's own message is about literals with base 10
        return f"must be an integer, got {text!r}"
    if convert is float:
        return f"must be a number, got {text!r}"
    return str(exc)


REGISTRY: dict[str, EnvVar] = {}


def _var(name: str, type_: type, readers: tuple[str, ...], help: str, *, internal: bool = False) -> EnvVar:
    assert name.startswith("KVMESH_") and name not in REGISTRY, name
    var = REGISTRY[name] = EnvVar(name, type_, readers, help, internal)
    return var


def variables(reader: str | None = None) -> list[EnvVar]:
    """The registered variables (those ``reader`` reads), by name."""
    return sorted((v for v in REGISTRY.values() if reader is None or reader in v.readers), key=lambda v: v.name)


# -- the mesh: every service (``kvmesh.settings.mesh``) ---------------------------------------
NATS_URL = _var("KVMESH_NATS_URL", str, SERVICES, "NATS server URL")
ETCD_ENDPOINTS = _var("KVMESH_ETCD_ENDPOINTS", str, (*SERVICES, ETCD_AUTH), "etcd endpoints host:port[,host:port]")
NAMESPACE = _var("KVMESH_NAMESPACE", str, SERVICES, "the mesh's namespace")
REQUEST_TIMEOUT = _var("KVMESH_REQUEST_TIMEOUT", float, SERVICES, "seconds for any single network wait")
REQUEST_DEADLINE = _var("KVMESH_REQUEST_DEADLINE", float, (*SERVICES, UP), "seconds a whole request may take")
SILENCE_TIMEOUT = _var("KVMESH_SILENCE_TIMEOUT", float, SERVICES, "a worker silent this long about a request is given up on")
HEARTBEAT_INTERVAL = _var("KVMESH_HEARTBEAT_INTERVAL", float, SERVICES, "seconds between a worker's progress messages")
NATS_CREDENTIALS = _var("KVMESH_NATS_CREDENTIALS", str, SERVICES, "credentials file with the NATS user and password")
ETCD_CREDENTIALS = _var("KVMESH_ETCD_CREDENTIALS", str, SERVICES, "credentials file with the etcd user and password")
NATS_TLS_CA = _var("KVMESH_NATS_TLS_CA", str, SERVICES, "CA certificate of the NATS server")
ETCD_TLS_CA = _var("KVMESH_ETCD_TLS_CA", str, (*SERVICES, ETCD_AUTH), "CA certificate of the etcd servers")
REQUIRE_TLS = _var("KVMESH_REQUIRE_TLS", bool, SERVICES, "1: refuse to start without TLS and credentials")

# -- the workers (``kvmesh.settings.worker``) -------------------------------------------------
WORKER_ID = _var("KVMESH_WORKER_ID", str, WORKERS, "the worker's id (default: host name and a random suffix)")
ENGINE = _var("KVMESH_ENGINE", str, WORKERS, "the engine a worker hosts: kvmesh or vllm")
MODEL = _var("KVMESH_MODEL", str, (ROUTER, *WORKERS), "model directory or .gguf file")
SERVED_MODEL_NAME = _var("KVMESH_SERVED_MODEL_NAME", str, (ROUTER, *WORKERS), "the model's name in the API and block hashes")
DEVICE = _var("KVMESH_DEVICE", str, WORKERS, "cpu, cuda or npu")
DTYPE = _var("KVMESH_DTYPE", str, (*WORKERS, UP), "float32, bfloat16, float16 or auto (the default: bfloat16 where the CPU or the CUDA GPU has native bf16, else float32)")
KV_CACHE_MIB = _var("KVMESH_KV_CACHE_MIB", int, WORKERS, "MiB of KV cache")
BLOCK_SIZE = _var("KVMESH_BLOCK_SIZE", int, WORKERS, "tokens per KV block (0: the engine's default)")
MAX_MODEL_LEN = _var("KVMESH_MAX_MODEL_LEN", int, WORKERS, "vllm: the longest sequence (0: the model's)")
CPU_BIND = _var("KVMESH_CPU_BIND", str, WORKERS, "vllm on CPU: the cores of its OpenMP threads")
TENSOR_PARALLEL_SIZE = _var("KVMESH_TENSOR_PARALLEL_SIZE", int, WORKERS, "vllm: processes its model (and KV pool) is split across (decode workers only)")
ENGINE_ARGS = _var("KVMESH_ENGINE_ARGS", str, WORKERS, "vllm: more EngineArgs as a JSON object")
MAX_NUM_SEQS = _var("KVMESH_MAX_NUM_SEQS", int, WORKERS, "requests a worker batches at most")
MAX_NUM_BATCHED_TOKENS = _var("KVMESH_MAX_NUM_BATCHED_TOKENS", int, WORKERS, "tokens in one engine step at most")
PREFIX_CACHING = _var("KVMESH_PREFIX_CACHING", bool, WORKERS, "0: no prefix caching")
NUM_THREADS = _var("KVMESH_NUM_THREADS", int, WORKERS, "torch threads (0: torch's default)")
LEND_CORES = _var("KVMESH_LEND_CORES", str, WORKERS, "PATH:SLOT of the board of engines that lend each other idle cores")
ADVERTISE_HOST = _var("KVMESH_ADVERTISE_HOST", str, WORKERS, "the address peers reach the transfer engine at (auto: this host's)")
LEASE_TTL = _var("KVMESH_LEASE_TTL", int, WORKERS, "seconds a dead worker stays in etcd")
PIN_TTL = _var("KVMESH_PIN_TTL", int, WORKERS, "seconds a prefill's blocks wait for the decode side's pull")
PIN_WRITE_DELAY = _var(
    "KVMESH_PIN_WRITE_DELAY", float, WORKERS, "seconds a pin is held before its etcd key is written (0: at once)"
)
LOAD_INTERVAL = _var("KVMESH_LOAD_INTERVAL", float, WORKERS, "seconds between load reports")
TRANSFER_PORTS = _var("KVMESH_TRANSFER_PORTS", str, WORKERS, "MIN-MAX: the ports of the Mooncake transfer engine")
DRAIN_TIMEOUT = _var("KVMESH_DRAIN_TIMEOUT", float, WORKERS, "seconds a stopping worker finishes its work in")
HEALTH_HOST = _var("KVMESH_HEALTH_HOST", str, (*WORKERS, KV_METADATA), "where /health and /metrics listen")
HEALTH_PORT = _var("KVMESH_HEALTH_PORT", int, (*WORKERS, KV_METADATA), "port of /health and /metrics (0: a free one)")
IDENTITY_SLOTS = _var(
    "KVMESH_IDENTITY_SLOTS", str, WORKERS, "a folder of the role's credentials files (or a list): run as one no live worker holds"
)
FAULT_PULL_DELAY = _var("KVMESH_FAULT_PULL_DELAY", float, (DECODE,), "tests: seconds a decode worker waits before pulling KV")
TEST_DEVICE = _var("KVMESH_TEST_DEVICE", str, (TESTS,), "the device the engine's reference tests run on: cpu (the default) or cuda (kvmesh.testing.device)")

# -- the router (``kvmesh.settings.router``) --------------------------------------------------
ROUTER_HOST = _var("KVMESH_ROUTER_HOST", str, (ROUTER,), "the router's listening address")
ROUTER_PORT = _var("KVMESH_ROUTER_PORT", int, (ROUTER,), "the router's port (0: a free one)")
API_KEY_FILE = _var("KVMESH_API_KEY_FILE", str, (ROUTER, UP), "file of API keys, one a line as name:key")
API_KEY = _var("KVMESH_API_KEY", str, (ROUTER, UP), "one API key, named default (read by kvmesh.services.router.api_keys)")
AUTH_METRICS = _var("KVMESH_AUTH_METRICS", bool, (ROUTER,), "1: /metrics needs a key too")
AUTH_DOCS = _var("KVMESH_AUTH_DOCS", bool, (ROUTER,), "1: /docs, /redoc and /openapi.json need a key too")
RATE_LIMITS = _var("KVMESH_RATE_LIMITS", str, (ROUTER,), "JSON or YAML file of per-key limits")
RATE_LIMIT_STORE = _var("KVMESH_RATE_LIMIT_STORE", str, (ROUTER,), "where token budgets are counted: local or nats")
CORS_ALLOW_ORIGINS = _var("KVMESH_CORS_ALLOW_ORIGINS", str, (ROUTER,), "comma-separated origins (or *) that may call the API")
GENERATION_CONFIG = _var("KVMESH_GENERATION_CONFIG", str, (ROUTER,), "sampling defaults: auto, vllm or a directory")
ROUTING_CONFIG = _var("KVMESH_ROUTING_CONFIG", str, (ROUTER,), "JSON or YAML file of scoring plugins and weights")
LOCAL_PREFILL_MAX_TOKENS = _var(
    "KVMESH_LOCAL_PREFILL_MAX_TOKENS", int, (ROUTER,),
    "the longest rest of a prompt a decode worker holding more of its prefix than any prefill worker prefills itself (0: never)",
)  # fmt: skip
KV_INDEX = _var(
    "KVMESH_KV_INDEX", str, (ROUTER,),
    "where the router learns which workers hold a prefix: replica (its own copy of the index) or kv-metadata (asked per request)",
)  # fmt: skip
KV_QUERY_TIMEOUT = _var(
    "KVMESH_KV_QUERY_TIMEOUT", float, (ROUTER,),
    "seconds the router waits for kv-metadata's prefix answer before routing a request by load alone",
)  # fmt: skip
MAX_BODY_BYTES = _var("KVMESH_MAX_BODY_BYTES", int, (ROUTER,), "larger request bodies get a 413")
BODY_TIMEOUT = _var("KVMESH_BODY_TIMEOUT", float, (ROUTER,), "seconds a request body may take to arrive")
MAX_HEADER_BYTES = _var("KVMESH_MAX_HEADER_BYTES", int, (ROUTER,), "a larger request head gets a 431")
HEADER_TIMEOUT = _var("KVMESH_HEADER_TIMEOUT", float, (ROUTER,), "seconds a request's head may take to arrive")

# -- kv-metadata (``kvmesh.settings.kv_metadata``) --------------------------------------------
SERVICE_ID = _var("KVMESH_SERVICE_ID", str, (KV_METADATA,), "the kv-metadata instance's id")
MIRROR_INTERVAL = _var("KVMESH_MIRROR_INTERVAL", float, (KV_METADATA,), "seconds between batched etcd mirror writes")
INGEST_SPAN_INTERVAL = _var("KVMESH_INGEST_SPAN_INTERVAL", float, (KV_METADATA,), "seconds of ingestion one kv_ingest span sums up")

# -- read where they are used, not through a settings object ---------------------------------
CACHE_DIR = _var("KVMESH_CACHE_DIR", str, (ROUTER, *WORKERS), "where models are fetched and converted to (kvmesh.engine.loader)")
PAGED_KERNEL = _var("KVMESH_PAGED_KERNEL", bool, WORKERS, "0: no compiled decode-attention kernel (kvmesh.engine.model)")
VLLM_PYTHON = _var("KVMESH_VLLM_PYTHON", str, (UP,), "the Python of a virtualenv with vLLM (kvmesh.worker.engines)")
ETCD_USERS = _var("KVMESH_ETCD_USERS", str, (ETCD_AUTH,), "etcd-users.json for kvmesh etcd-auth")
SECRETS = _var("KVMESH_SECRETS", str, (COMPOSE,), "the compose file's folder of secrets (deploy/compose/secrets)")
TRANSFER_BIND = _var("KVMESH_TRANSFER_BIND", str, WORKERS, "the bind guard's address (kvmesh.transfer.bind_guard)", internal=True)
TRANSFER_BIND_PORTS = _var("KVMESH_TRANSFER_BIND_PORTS", str, WORKERS, "the bind guard's ports", internal=True)
BIND_GUARD_EXEC = _var("KVMESH_BIND_GUARD_EXEC", str, WORKERS, "set across the bind guard's one re-exec", internal=True)


def table() -> str:
    """The registry as a Markdown table, for the docs (``python -m kvmesh.settings``)."""
    rows = ["| variable | type | read by | meaning |", "|---|---|---|---|"]
    for var in variables():
        readers = ", ".join(var.readers) + (" (internal)" if var.internal else "")
        rows.append(f"| `{var.name}` | {var.type.__name__} | {readers} | {var.help} |")
    return "\n".join(rows)

