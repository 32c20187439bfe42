"""A worker's settings: its engine's (``EngineSettings``, handed to the engine as it is)
and its own in the mesh (``WorkerSettings``), from flags and ``KVMESH_*`` variables
(``worker_settings``)."""

from __future__ import annotations

import logging
import socket
import uuid
from dataclasses import dataclass, field

from kvmesh.machine import DTYPE_CHOICES, default_dtype
from kvmesh.protocol import Role
from kvmesh.settings import env
from kvmesh.settings.env import EnvError
from kvmesh.settings.flags import SettingsParser, from_args
from kvmesh.settings.values import host_address, non_negative_number, port_number, positive_int, positive_number, positive_or_unset
from kvmesh.settings.mesh import MeshSettings, add_mesh_args, mesh_settings
from kvmesh.transfer.mooncake_agent import mooncake_env_range, parse_port_range
from kvmesh.worker.engines import (
    DEFAULT_BLOCK_SIZE,
    ENGINES,
    block_size_problem,
    engine_args_problem,
    parallel_problem,
    unavailable,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class EngineSettings:
    """What the engine a worker hosts is to be (``kvmesh.worker.engines.create_engine``)."""

    name: str = "kvmesh"  # which engine (``kvmesh.worker.engines``): kvmesh's own or vllm
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
    # PATH:SLOT of a board of engines on this machine that lend each other their cores while
    # idle (``kvmesh.engine.core_lending``); None: ``num_threads`` always
    lend_cores: str | None = None
    # vLLM only (``kvmesh.worker.vllm_engine``): the longest sequence (None: the model's),
    # the cores its OpenMP threads are bound to (VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or
    # "0-1"; None: the first ``num_threads`` cores this process may run on, or all of them
    # with ``lend_cores``), and further
    # ``EngineArgs`` as a JSON object (``{"enforce_eager": false}``), applied last.
    max_model_len: int | None = None
    cpu_bind: str | None = None
    engine_args: str | None = None
    # vLLM only: its worker processes, the model's heads (and the KV pool) split between them
    tensor_parallel_size: int = 1


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


@dataclass(slots=True, frozen=True)
class WorkerSettings:
    role: Role
    mesh: MeshSettings
    engine: EngineSettings = field(default_factory=EngineSettings)
    worker_id: str = field(default_factory=new_worker_id)
    advertise_host: str = "127.0.0.1"  # the address peers reach this worker's transfer engine at
    lease_ttl: int = 5  # seconds: a dead worker leaves etcd within this
    pin_ttl: int = 30  # seconds a prefill's blocks wait for the decode side's pull
    # seconds a pin is held before its etcd key is written (``prefill_worker.pins``): a pull that
    # comes sooner, the usual case, costs etcd nothing; 0 writes every pin at once
    pin_write_delay: float = 1.0
    transfer_port_range: tuple[int, int] | None = None  # where Mooncake listens (both ports); None: its default
    # seconds a decode worker waits in line for room for a pull (at most pin_ttl - 5): a busy decode
    # worker's pulls queue rather than come back overloaded (each then prefilled again)
    import_wait: float = 25.0
    load_interval: float = 0.5  # seconds between load reports
    drain_timeout: float = 60.0
    health_host: str = "127.0.0.1"  # where the liveness / readiness endpoint listens
    health_port: int = 0  # 0: a free port (logged, and in the worker's etcd record)
    # Credentials files of the role's identities; given, the worker runs as the first one no live
    # worker holds, claimed at start (``kvmesh.cluster.identity_slots``): its id and credentials.
    identity_slots: tuple[str, ...] = ()
    engine_stall_limit: float = 60.0  # an engine that has not gone round its loop for this long is not ready
    # Fault injection for tests: seconds a decode worker waits before pulling KV, so a test
    # can kill the prefill worker in between. Read from KVMESH_FAULT_PULL_DELAY only.
    fault_pull_delay: float = 0.0


def worker_parser(role: Role) -> SettingsParser:
    parser = SettingsParser(prog=f"kvmesh-{role}-worker", description=f"kvmesh {role} worker")
    add_mesh_args(parser)
    option = parser.option
    option("--worker-id", env=env.WORKER_ID)
    option(
        "--engine", env=env.ENGINE, default="kvmesh", choices=ENGINES,
        help="the engine this worker hosts: kvmesh (its own) or vllm (installed with `make vllm`) (KVMESH_ENGINE)",
    )  # fmt: skip
    option("--model", env=env.MODEL, help="model dir or .gguf (default: SmolLM2-135M-Instruct)")
    option("--served-model-name", env=env.SERVED_MODEL_NAME)
    option("--device", env=env.DEVICE, default="cpu")
    option(
        "--dtype", env=env.DTYPE, default="auto", choices=DTYPE_CHOICES,
        help="auto: bfloat16 where the CPU (AVX512-BF16 / AMX) or the CUDA GPU (compute capability 8.0 on) has native bf16, else float32 (KVMESH_DTYPE)",
    )  # fmt: skip
    option("--kv-cache-mib", env=env.KV_CACHE_MIB, type=positive_int, default=512)
    option(
        "--block-size", env=env.BLOCK_SIZE, type=positive_int, from_env=positive_or_unset,
        help=f"tokens per KV block (KVMESH_BLOCK_SIZE; default {DEFAULT_BLOCK_SIZE['kvmesh']}, "
        f"{DEFAULT_BLOCK_SIZE['vllm']} with vllm, whose CPU backend takes multiples of 32)",
    )  # fmt: skip
    option(
        "--max-model-len", env=env.MAX_MODEL_LEN, type=positive_int, from_env=positive_or_unset,
        help="vllm: the longest sequence, prompt and output (KVMESH_MAX_MODEL_LEN; default the model's)",
    )  # fmt: skip
    option(
        "--cpu-bind", env=env.CPU_BIND,
        help="vllm on CPU: cores of its OpenMP threads, as VLLM_CPU_OMP_THREADS_BIND (KVMESH_CPU_BIND; "
        "default the first --num-threads cores this process may use; with --lend-cores all of them)",
    )  # fmt: skip
    option(
        "--tensor-parallel-size", env=env.TENSOR_PARALLEL_SIZE, type=positive_int, default=1,
        help="vllm: worker processes the model (and its KV pool) is split across, each on its share of --cpu-bind's cores "
        "(KVMESH_TENSOR_PARALLEL_SIZE)",
    )  # fmt: skip
    option(
        "--engine-args", env=env.ENGINE_ARGS, metavar="JSON",
        help='vllm: more EngineArgs as a JSON object, e.g. \'{"enforce_eager": false}\' (KVMESH_ENGINE_ARGS)',
    )  # fmt: skip
    option("--max-num-seqs", env=env.MAX_NUM_SEQS, type=positive_int, default=64)
    option("--max-num-batched-tokens", env=env.MAX_NUM_BATCHED_TOKENS, type=positive_int, default=1024)
    option("--no-prefix-caching", env=env.PREFIX_CACHING, action="store_true", default=False, from_env=lambda text: text == "0")
    option("--num-threads", env=env.NUM_THREADS, type=positive_int, from_env=positive_or_unset)
    option(
        "--lend-cores", env=env.LEND_CORES, metavar="PATH:SLOT",
        help="this engine's slot on a board of engines on this machine (kvmesh up makes it where the workers split the cores); "
        "it runs on every core this process may use while the others are idle, else --num-threads (KVMESH_LEND_CORES)",
    )  # fmt: skip
    option(
        "--advertise-host", env=env.ADVERTISE_HOST, type=host_address, default="127.0.0.1",
        help="address peers reach this worker's transfer engine at; 'auto' resolves this host's name",
    )  # fmt: skip
    option("--lease-ttl", env=env.LEASE_TTL, type=positive_int, default=5)
    option("--pin-ttl", env=env.PIN_TTL, type=positive_int, default=30)
    option(
        "--pin-write-delay", env=env.PIN_WRITE_DELAY, type=non_negative_number, default=1.0,
        help="seconds a prefill's pin is held before its etcd key is written; a pull that comes sooner costs etcd nothing (0: at once) (KVMESH_PIN_WRITE_DELAY)",
    )  # fmt: skip
    option("--load-interval", env=env.LOAD_INTERVAL, type=positive_number, default=0.5)
    option(
        "--transfer-ports", env=env.TRANSFER_PORTS, metavar="MIN-MAX",
        help="port range of the Mooncake transfer engine's two listeners, to fence them (KVMESH_TRANSFER_PORTS)",
    )  # fmt: skip
    option("--drain-timeout", env=env.DRAIN_TIMEOUT, type=non_negative_number, default=60.0)
    option("--health-host", env=env.HEALTH_HOST, type=host_address, default="127.0.0.1", help="(KVMESH_HEALTH_HOST)")
    option(
        "--health-port", env=env.HEALTH_PORT, type=port_number, default=0,
        help="port of /health/live and /health/ready; 0 picks a free one (KVMESH_HEALTH_PORT)",
    )  # fmt: skip
    option(
        "--identity-slots", env=env.IDENTITY_SLOTS, metavar="DIR|FILE,FILE",
        help="run as one of these identities no live worker holds, claimed in etcd at start: a folder's "
        "<role>-*.json credentials files or a list of them; sets the worker id and credentials (KVMESH_IDENTITY_SLOTS)",
    )  # fmt: skip
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


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
    problem = engine_args_problem(args.engine_args) if args.engine_args is not None else None
    if problem is not None:
        parser.error(problem)
    if args.dtype == "auto":
        args.dtype, why = default_dtype(args.device)
        logger.info("dtype auto: %s, since %s", args.dtype, why)
    slots: tuple[str, ...] = ()
    if args.identity_slots:  # the id and credentials are the identity claimed at start
        from kvmesh.cluster.identity_slots import SlotError, slot_files

        if args.worker_id or args.nats_credentials or args.etcd_credentials:
            parser.error("--identity-slots gives the worker id and credentials: not with --worker-id or --*-credentials")
        try:
            slots = tuple(map(str, slot_files(args.identity_slots, role)))
        except SlotError as exc:
            parser.error(str(exc))
        args.nats_credentials = args.etcd_credentials = slots[0]  # checked here like any; replaced at the claim
    if not 0 <= args.pin_write_delay < args.pin_ttl:
        parser.error(f"--pin-write-delay must be at least 0 and less than --pin-ttl ({args.pin_ttl}), not {args.pin_write_delay:g}")
    mesh = mesh_settings(args, parser)
    try:
        # Mooncake's own MC_MIN_RPC_PORT / MC_MAX_RPC_PORT, when set, are the range it uses:
        # taken as the range so that the bind guard fences those ports, not its default ones
        transfer_port_range = parse_port_range(args.transfer_ports) if args.transfer_ports else mooncake_env_range()
        fault_pull_delay = env.FAULT_PULL_DELAY.read(float, 0.0)
        engine = from_args(
            EngineSettings, args,
            name=args.engine,
            kv_cache_bytes=args.kv_cache_mib * 2**20,
            block_size=args.block_size or DEFAULT_BLOCK_SIZE[args.engine],
            enable_prefix_caching=not args.no_prefix_caching,
        )  # fmt: skip
    except (EnvError, ValueError) as exc:
        parser.error(str(exc))
    problem = block_size_problem(engine.name, engine.device, engine.block_size)
    problem = problem or parallel_problem(engine)
    if problem is not None:
        parser.error(problem)
    return from_args(
        WorkerSettings, args,
        role=role,
        mesh=mesh,
        engine=engine,
        worker_id=args.worker_id or new_worker_id(),
        advertise_host=resolve_advertise_host(args.advertise_host),
        transfer_port_range=transfer_port_range,
        fault_pull_delay=fault_pull_delay,
        identity_slots=slots,
    )  # fmt: skip
