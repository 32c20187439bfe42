"""Worker settings from flags and ``KVMESH_*`` environment variables; logged once at start."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import uuid
from dataclasses import asdict, dataclass, field
from typing import overload

from kvmesh.machine import default_dtype
from kvmesh.protocol import Role
from kvmesh.transfer.mooncake_agent import parse_port_range
from kvmesh.worker.engines import DEFAULT_BLOCK_SIZE, ENGINES, unavailable

logger = logging.getLogger(__name__)


@overload
def _env(name: str) -> str | None: ...
@overload
def _env(name: str, default: str) -> str: ...
def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"KVMESH_{name}", default)


@dataclass(slots=True, frozen=True)
class MeshSettings:
    """Where the mesh is: NATS, etcd, the namespace. No defaults: a missing one fails at start."""

    nats_url: str
    etcd_endpoints: tuple[str, ...]
    namespace: str = "default"
    request_timeout: float = 30.0  # seconds for any single network wait (connect, ack, query)
    request_deadline: float = 1800.0  # seconds a whole request may take, retries included
    silence_timeout: float = 5.0  # a worker working on a request says so at least this often
    heartbeat_interval: float = 0.5  # how often workers say so (``Progress``)
    # Paths of credentials files (``kvmesh.security.credentials``; one file may hold both);
    # None: connect anonymously, as to a mesh without auth.
    nats_credentials: str | None = None
    etcd_credentials: str | None = None
    # Paths of the CA certificates the NATS and etcd servers' certificates are signed by
    # (``kvmesh.security.tls``); given: TLS only, trusting that CA alone. None: plaintext.
    nats_tls_ca: str | None = None
    etcd_tls_ca: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval < self.silence_timeout:
            raise ValueError("the heartbeat interval must be positive and shorter than the silence timeout")


@dataclass(slots=True, frozen=True)
class WorkerSettings:
    role: Role
    mesh: MeshSettings
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
    engine: str = "kvmesh"  # which engine the worker hosts (``kvmesh.worker.engines``)
    model: str | None = None
    served_model_name: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_bytes: int = 512 * 2**20
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch threads; None: torch's default
    # vLLM only (``kvmesh.worker.vllm_engine``): the longest sequence (None: the model's),
    # the cores its OpenMP threads are bound to (VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or
    # "0-1"; None: the first ``num_threads`` cores this process may run on), and further
    # ``EngineArgs`` as a JSON object (``{"enforce_eager": false}``), applied last.
    max_model_len: int | None = None
    cpu_bind: str | None = None
    engine_args: str | None = None
    advertise_host: str = "127.0.0.1"  # the address peers reach this worker's transfer engine at
    lease_ttl: int = 5  # seconds: a dead worker leaves etcd within this
    pin_ttl: int = 30  # seconds a prefill's blocks wait for the decode side's pull
    transfer_port_range: tuple[int, int] | None = None  # where Mooncake listens (both ports); None: its default
    import_wait: float = 10.0  # seconds a decode worker waits for room for a pull (less than pin_ttl)
    load_interval: float = 0.5  # seconds between load reports
    drain_timeout: float = 60.0
    health_host: str = "127.0.0.1"  # where the liveness / readiness endpoint listens
    health_port: int = 0  # 0: a free port (logged, and in the worker's etcd record)
    engine_stall_limit: float = 60.0  # an engine that has not gone round its loop for this long is not ready
    # Fault injection for tests: seconds a decode worker waits before pulling KV, so a test
    # can kill the prefill worker in between. Read from KVMESH_FAULT_PULL_DELAY only.
    fault_pull_delay: float = float(os.environ.get("KVMESH_FAULT_PULL_DELAY", "0"))

    def log(self) -> None:
        from kvmesh.telemetry import log_settings

        values = asdict(self)
        values.update({f"mesh.{k}": v for k, v in values.pop("mesh").items()})
        log_settings(f"{self.role} worker", values)


def add_mesh_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=_env("NATS_URL"), help="NATS server URL (KVMESH_NATS_URL)")
    parser.add_argument(
        "--etcd", default=_env("ETCD_ENDPOINTS"), help="etcd endpoints host:port[,host:port] (KVMESH_ETCD_ENDPOINTS)"
    )
    parser.add_argument("--namespace", default=_env("NAMESPACE", "default"), help="mesh namespace (KVMESH_NAMESPACE)")
    parser.add_argument(
        "--request-timeout", type=float, default=float(_env("REQUEST_TIMEOUT", "30")),
        help="seconds for any single network wait: connect, ack, query (KVMESH_REQUEST_TIMEOUT)",
    )
    parser.add_argument(
        "--request-deadline", type=float, default=float(_env("REQUEST_DEADLINE", "1800")),
        help="seconds a whole request may take, retries included (KVMESH_REQUEST_DEADLINE)",
    )
    parser.add_argument(
        "--silence-timeout", type=float, default=float(_env("SILENCE_TIMEOUT", "5")),
        help="a worker silent this long about a request is given up on (KVMESH_SILENCE_TIMEOUT)",
    )
    parser.add_argument(
        "--heartbeat-interval", type=float, default=float(_env("HEARTBEAT_INTERVAL", "0.5")),
        help="seconds between a worker's progress messages for a request (KVMESH_HEARTBEAT_INTERVAL)",
    )
    parser.add_argument(
        "--nats-credentials", default=_env("NATS_CREDENTIALS"), metavar="FILE",
        help="credentials file (mode 0600) with the NATS user and password (KVMESH_NATS_CREDENTIALS)",
    )
    parser.add_argument(
        "--etcd-credentials", default=_env("ETCD_CREDENTIALS"), metavar="FILE",
        help="credentials file (mode 0600) with the etcd user and password (KVMESH_ETCD_CREDENTIALS)",
    )
    parser.add_argument(
        "--nats-tls-ca", default=_env("NATS_TLS_CA"), metavar="FILE",
        help="CA certificate of the NATS server: TLS (handshake first), trusting this CA only (KVMESH_NATS_TLS_CA)",
    )
    parser.add_argument(
        "--etcd-tls-ca", default=_env("ETCD_TLS_CA"), metavar="FILE",
        help="CA certificate of the etcd servers: TLS, trusting this CA only (KVMESH_ETCD_TLS_CA)",
    )
    parser.add_argument(
        "--require-tls", action="store_true", default=_env("REQUIRE_TLS", "0") == "1",
        help="refuse to start without --nats-tls-ca and --etcd-tls-ca and both credentials files (KVMESH_REQUIRE_TLS=1)",
    )


def mesh_settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> MeshSettings:
    if not args.nats_url:
        parser.error("--nats-url (or KVMESH_NATS_URL) is required")
    if not args.etcd:
        parser.error("--etcd (or KVMESH_ETCD_ENDPOINTS) is required")
    settings = MeshSettings(
        nats_url=args.nats_url,
        etcd_endpoints=tuple(e.strip() for e in args.etcd.split(",") if e.strip()),
        namespace=args.namespace,
        request_timeout=args.request_timeout,
        request_deadline=args.request_deadline,
        silence_timeout=args.silence_timeout,
        heartbeat_interval=args.heartbeat_interval,
        nats_credentials=_checked_credentials(args.nats_credentials, "nats", parser),
        etcd_credentials=_checked_credentials(args.etcd_credentials, "etcd", parser),
        nats_tls_ca=_checked_ca(args.nats_tls_ca, "--nats-tls-ca", parser),
        etcd_tls_ca=_checked_ca(args.etcd_tls_ca, "--etcd-tls-ca", parser),
    )
    if args.require_tls:
        missing = [
            flag for flag, value in (
                ("--nats-tls-ca", settings.nats_tls_ca), ("--etcd-tls-ca", settings.etcd_tls_ca),
                ("--nats-credentials", settings.nats_credentials), ("--etcd-credentials", settings.etcd_credentials),
            ) if not value
        ]  # fmt: skip
        if missing:
            parser.error(f"--require-tls (KVMESH_REQUIRE_TLS): {', '.join(missing)} missing")
    return settings


def _checked_ca(path: str | None, flag: str, parser: argparse.ArgumentParser) -> str | None:
    """A CA certificate file that is there and is PEM: fail at start, not at the first connect."""
    if not path:
        return None
    try:
        text = open(path).read()
    except OSError as exc:
        parser.error(f"{flag} {path}: {exc.strerror or exc}")
    if "-----BEGIN CERTIFICATE-----" not in text:
        parser.error(f"{flag} {path}: not a PEM certificate")
    return path


def _checked_credentials(path: str | None, section: str, parser: argparse.ArgumentParser) -> str | None:
    """A credentials file that is there, private and has ``section``: fail at start, not later."""
    from kvmesh.security.credentials import CredentialsError, load_credentials

    if path:
        try:
            load_credentials(path, section)
        except CredentialsError as exc:
            parser.error(str(exc))
    return path or None


def worker_parser(role: Role) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"kvmesh-{role}-worker", description=f"kvmesh {role} worker")
    add_mesh_args(parser)
    parser.add_argument("--worker-id", default=_env("WORKER_ID"))
    parser.add_argument(
        "--engine", default=_env("ENGINE", "kvmesh"), choices=ENGINES,
        help="the engine this worker hosts: kvmesh (its own) or vllm (installed with `make vllm`) (KVMESH_ENGINE)",
    )
    parser.add_argument("--model", default=_env("MODEL"), help="model dir or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=_env("SERVED_MODEL_NAME"))
    parser.add_argument("--device", default=_env("DEVICE", "cpu"))
    parser.add_argument(
        "--dtype", default=_env("DTYPE", "float32"), choices=["float32", "bfloat16", "float16", "auto"],
        help="auto: bfloat16 where the CPU has native bf16 (AVX512-BF16 / AMX), else float32 (KVMESH_DTYPE)",
    )
    parser.add_argument("--kv-cache-mib", type=int, default=int(_env("KV_CACHE_MIB", "512")))
    parser.add_argument(
        "--block-size", type=int, default=int(_env("BLOCK_SIZE", "0")) or None,
        help=f"tokens per KV block (KVMESH_BLOCK_SIZE; default {DEFAULT_BLOCK_SIZE['kvmesh']}, "
        f"{DEFAULT_BLOCK_SIZE['vllm']} with vllm, whose CPU backend takes multiples of 32)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=int(_env("MAX_MODEL_LEN", "0")) or None,
        help="vllm: the longest sequence, prompt and output (KVMESH_MAX_MODEL_LEN; default the model's)",
    )
    parser.add_argument(
        "--cpu-bind", default=_env("CPU_BIND"),
        help="vllm on CPU: cores of its OpenMP threads, as VLLM_CPU_OMP_THREADS_BIND (KVMESH_CPU_BIND; "
        "default the first --num-threads cores this process may use)",
    )
    parser.add_argument(
        "--engine-args", default=_env("ENGINE_ARGS"), metavar="JSON",
        help='vllm: more EngineArgs as a JSON object, e.g. \'{"enforce_eager": false}\' (KVMESH_ENGINE_ARGS)',
    )
    parser.add_argument("--max-num-seqs", type=int, default=int(_env("MAX_NUM_SEQS", "64")))
    parser.add_argument("--max-num-batched-tokens", type=int, default=int(_env("MAX_NUM_BATCHED_TOKENS", "1024")))
    parser.add_argument("--no-prefix-caching", action="store_true", default=_env("PREFIX_CACHING", "1") == "0")
    parser.add_argument("--num-threads", type=int, default=int(_env("NUM_THREADS", "0")) or None)
    parser.add_argument(
        "--advertise-host",
        default=_env("ADVERTISE_HOST", "127.0.0.1"),
        help="address peers reach this worker's transfer engine at; 'auto' resolves this host's name",
    )
    parser.add_argument("--lease-ttl", type=int, default=int(_env("LEASE_TTL", "5")))
    parser.add_argument("--pin-ttl", type=int, default=int(_env("PIN_TTL", "30")))
    parser.add_argument("--load-interval", type=float, default=float(_env("LOAD_INTERVAL", "0.5")))
    parser.add_argument(
        "--transfer-ports", default=_env("TRANSFER_PORTS"), metavar="MIN-MAX",
        help="port range of the Mooncake transfer engine's two listeners, to fence them (KVMESH_TRANSFER_PORTS)",
    )
    parser.add_argument("--drain-timeout", type=float, default=float(_env("DRAIN_TIMEOUT", "60")))
    parser.add_argument("--health-host", default=_env("HEALTH_HOST", "127.0.0.1"), help="(KVMESH_HEALTH_HOST)")
    parser.add_argument(
        "--health-port", type=int, default=int(_env("HEALTH_PORT", "0")),
        help="port of /health/live and /health/ready; 0 picks a free one (KVMESH_HEALTH_PORT)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def _check_engine_args(text: str, parser: argparse.ArgumentParser) -> None:
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        parser.error(f"--engine-args: not JSON ({exc})")
    if not isinstance(value, dict):
        parser.error("--engine-args: must be a JSON object of EngineArgs fields")


def resolve_advertise_host(value: str) -> str:
    """``auto``: this host's own address (a container's, in compose or Kubernetes)."""
    if value == "auto":
        return socket.gethostbyname(socket.gethostname())
    return value


def worker_settings(role: Role, argv: list[str] | None = None) -> WorkerSettings:
    parser = worker_parser(role)
    args = parser.parse_args(argv)
    reason = unavailable(args.engine)
    if reason is not None:
        parser.error(reason)
    if args.engine_args is not None:
        _check_engine_args(args.engine_args, parser)
    if args.dtype == "auto":
        args.dtype, why = default_dtype(args.device.split(":")[0])
        logger.info("dtype auto: %s, since %s", args.dtype, why)
    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    return WorkerSettings(
        role=role,
        mesh=mesh_settings(args, parser),
        engine=args.engine,
        model=args.model,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_mib * 2**20,
        block_size=args.block_size or DEFAULT_BLOCK_SIZE[args.engine],
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.num_threads,
        max_model_len=args.max_model_len,
        cpu_bind=args.cpu_bind,
        engine_args=args.engine_args,
        advertise_host=resolve_advertise_host(args.advertise_host),
        lease_ttl=args.lease_ttl,
        pin_ttl=args.pin_ttl,
        load_interval=args.load_interval,
        drain_timeout=args.drain_timeout,
        transfer_port_range=parse_port_range(args.transfer_ports) if args.transfer_ports else None,
        health_host=args.health_host,
        health_port=args.health_port,
        **extra,
    )
