"""``kvmesh up``: check the arguments at once, run a supervised ``LocalMesh``, stop it on a
signal.

Bad arguments (a busy port, a missing model path, ...) are found before anything starts and
reported on one line with exit code 2. The router's and the workers' own options are taken too
(``SERVICE_OPTIONS``) and forwarded to the services it starts, or set in their environment. SIGINT, SIGTERM and SIGHUP stop the whole mesh (exit
0); a second one during the stop SIGKILLs what is left. While serving, a child that dies is
restarted (``supervisor``); the mesh stops only on the user's signal.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvmesh.errors import KvmeshError
from kvmesh.settings import env
from kvmesh.settings.values import non_negative_int, non_negative_number, positive_int, positive_number

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # the loader's name for it (importing the loader takes a while)


class UpUsageError(KvmeshError):
    """A bad argument, found before anything started."""


class _Stopped(BaseException):
    """The user's signal, raised in the main thread (wherever start had got to)."""


def progress(message: str) -> None:
    sys.stderr.write(f"kvmesh up: {message}\n")
    sys.stderr.flush()


# -- the services' own options -----------------------------------------------------------
@dataclass(frozen=True)
class ServiceOption:
    """A router or worker flag ``kvmesh up`` takes and hands on: to the router, to every worker,
    to both, or (``env``) to every service as the environment variable it reads."""

    flag: str
    to: Literal["router", "workers", "both", "env"]
    help: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    env: str = ""
    path: bool = False  # a file or directory: made absolute, since the services run elsewhere

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


POSITIVE_INT = {"type": positive_int}
POSITIVE_FLOAT = {"type": positive_number}
# what only vLLM's workers read (``kvmesh.worker.vllm_engine``): kvmesh's engine would ignore it
VLLM_ONLY = ("--max-model-len", "--engine-args", "--tensor-parallel-size")


def _file_or_setting(*settings: str) -> Any:
    return lambda value: value if value in settings else str(Path(value).expanduser().resolve())


SERVICE_OPTIONS = (
    ServiceOption("--served-model-name", "both", "the model's name in the API and in the KV block hashes (default: the model's)"),
    ServiceOption("--rate-limits", "router", 'JSON or YAML file of per-key limits: {"keys": {name: {...}}, "default": {...}}', path=True),
    ServiceOption("--rate-limit-store", "router", "where token budgets are counted (default: local)", {"choices": ["local", "nats"]}),
    ServiceOption("--auth-metrics", "router", "/metrics needs an API key too", {"action": "store_true"}),
    ServiceOption("--auth-docs", "router", "/docs and /openapi.json need an API key too", {"action": "store_true"}),
    ServiceOption("--cors-allow-origins", "router", "comma-separated origins (or *) whose pages may call the API (default: none, CORS off)"),
    ServiceOption(
        "--generation-config", "router",
        "sampling defaults: auto (the model's generation_config.json), vllm (none) or a directory (default: auto)",
        {"type": _file_or_setting("auto", "vllm")},
    ),  # fmt: skip
    ServiceOption("--max-attempts", "router", "tries per request (default: 3)", POSITIVE_INT),
    ServiceOption(
        "--local-prefill-max-tokens", "router",
        "a decode worker holding more of a prompt's prefix than any prefill worker prefills it itself when at most this "
        "many tokens are not cached there (default: 256; 0: never)",
        {"type": non_negative_int},
    ),  # fmt: skip
    ServiceOption(
        "--kv-index", "router",
        "which workers hold a prompt's prefix: the router's own copy of the index (replica, the default) or kv-metadata's answer",
        {"choices": ["replica", "kv-metadata"]},
    ),  # fmt: skip
    ServiceOption("--max-body-bytes", "router", "larger request bodies get a 413 (default: 4 MiB)", POSITIVE_INT),
    ServiceOption("--body-timeout", "router", "seconds a request body may take (default: 10)", POSITIVE_FLOAT),
    ServiceOption("--max-header-bytes", "router", "a larger request head gets a 431 (default: 32 KiB)", POSITIVE_INT),
    ServiceOption("--header-timeout", "router", "seconds a request head may take (default: 10)", POSITIVE_FLOAT),
    ServiceOption("--device", "workers", "cpu, cuda or npu (default: cpu)"),
    ServiceOption("--max-model-len", "workers", "vllm: the longest sequence, prompt and output (default: the model's)", POSITIVE_INT),
    ServiceOption("--max-num-seqs", "workers", "requests a worker batches at most (default: 64)", POSITIVE_INT),
    ServiceOption("--max-num-batched-tokens", "workers", "tokens in one engine step at most (default: 1024)", POSITIVE_INT),
    ServiceOption(
        "--tensor-parallel-size", "workers",
        "vllm: worker processes each worker's model (and KV pool) is split across (default: 1)",
        POSITIVE_INT,
    ),  # fmt: skip
    ServiceOption("--engine-args", "workers", 'vllm: more EngineArgs as a JSON object, e.g. \'{"enforce_eager": false}\'', {"metavar": "JSON"}),
    ServiceOption("--drain-timeout", "workers", "seconds a stopping worker finishes its work in (default: 60)", {"type": non_negative_number}),
    ServiceOption("--load-interval", "workers", "seconds between a worker's load reports (default: 0.5)", POSITIVE_FLOAT),
    ServiceOption("--pin-write-delay", "workers", "seconds a pin is held before its etcd key is written (default: 1; 0: at once)", {"type": non_negative_number}),
    ServiceOption("--request-deadline", "env", "seconds a whole request may take, retries included (default: 1800)", POSITIVE_FLOAT, env="KVMESH_REQUEST_DEADLINE"),
    ServiceOption("--silence-timeout", "env", "a worker silent this long about a request is given up on (default: 5)", POSITIVE_FLOAT, env="KVMESH_SILENCE_TIMEOUT"),
    ServiceOption("--heartbeat-interval", "env", "seconds between a worker's progress messages (default: 0.5)", POSITIVE_FLOAT, env="KVMESH_HEARTBEAT_INTERVAL"),
)


def add_service_args(parser: argparse.ArgumentParser) -> None:
    """The router's and the workers' options, each left to the service when not given."""
    groups = {
        "router": parser.add_argument_group("the router's options (forwarded to it)"),
        "workers": parser.add_argument_group("the workers' options (forwarded to every worker)"),
    }
    groups["both"] = groups["router"]
    groups["env"] = parser.add_argument_group("every service's options")
    for option in SERVICE_OPTIONS:
        kwargs = dict(option.kwargs)
        if option.path:
            kwargs["type"] = _file_or_setting()
        groups[option.to].add_argument(option.flag, help=option.help, **kwargs)


def service_args(args: argparse.Namespace) -> tuple[list[str], list[str], dict[str, str]]:
    """The router's flags, every worker's and the services' environment, for what was given."""
    router: list[str] = []
    workers: list[str] = []
    env: dict[str, str] = {}
    for option in SERVICE_OPTIONS:
        value = getattr(args, option.dest)
        if value is None or value is False:
            continue
        if option.to == "env":
            env[option.env] = str(value)
            continue
        argv = [option.flag] if value is True else [option.flag, str(value)]
        if option.to in ("router", "both"):
            router += argv
        if option.to in ("workers", "both"):
            workers += argv
    return router, workers, env


# -- checks, all before anything starts ---------------------------------------------------
def check_model(model: str | None, engine: str = "kvmesh") -> None:
    """The model is there, and (a directory for kvmesh's engine) its config.json is one the
    engine reads: a worker that found otherwise would fail after the servers had started."""
    if model is None or model == DEFAULT_MODEL:
        return
    path = Path(model).expanduser()
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as exc:  # a name too long, say
        raise UpUsageError(f"--model {model[:80]}{'...' if len(model) > 80 else ''}: {exc.strerror or exc}") from None
    if not exists:
        raise UpUsageError(f"model path {model} does not exist")
    if is_dir and not (path / "config.json").is_file():
        raise UpUsageError(f"model directory {model} has no config.json")
    if not is_dir and path.suffix.lower() != ".gguf":
        raise UpUsageError(f"model {model} is neither a model directory nor a .gguf file")
    if is_dir and engine == "kvmesh":
        from kvmesh.engine.model.config import ModelConfig
        from kvmesh.errors import ModelLoadError

        try:
            ModelConfig.from_dir(path)
        except ModelLoadError as exc:
            raise UpUsageError(f"--model {model}: {exc}") from None


def check_port(host: str, port: int) -> None:
    """Bind ``host``:``port`` as the router will (SO_REUSEADDR), and let it go again."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        address = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    except socket.gaierror as exc:
        raise UpUsageError(f"--host {host}: {exc.strerror}") from None
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UpUsageError(f"port {port} on {host} is in use") from None
            raise UpUsageError(f"cannot listen on {host} port {port}: {exc.strerror}") from None


LOCK_FILE = "kvmesh-up.lock"  # in the workdir: held by the kvmesh up using it, with its PID
_workdir_lock: Any = None  # the open lock file, held until this process exits


def check_workdir(workdir: str | None) -> Path:
    """The workdir, made, writable and this process's alone: a second ``kvmesh up`` writing
    its credentials, CA and ``pids.json`` over a running one's would leave that mesh's
    restarted services unable to connect."""
    global _workdir_lock
    if workdir is None:
        path = Path(tempfile.mkdtemp(prefix="kvmesh-up-"))
    else:
        path = Path(workdir).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UpUsageError(f"--workdir {workdir}: {exc.strerror or exc}") from None
    import fcntl

    try:
        lock = open(path / LOCK_FILE, "a+")  # noqa: SIM115 - held open for the process's life
    except OSError as exc:
        raise UpUsageError(f"--workdir {workdir}: not writable ({exc.strerror or exc})") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise UpUsageError(f"--workdir {workdir} is in use by another kvmesh up (PID {holder})") from None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    _workdir_lock = lock
    return path


def forget_workdir(workdir: Path, *, keep_logs: bool) -> None:
    """A temporary workdir (no ``--workdir``) is removed once the mesh has stopped: the mesh's
    credentials, its CA's key and etcd's data go with it. After a failure the logs stay, the
    rest goes, and the last line says where they are."""
    import shutil

    if not keep_logs:
        shutil.rmtree(workdir, ignore_errors=True)
        return
    for entry in workdir.iterdir():
        if entry.is_dir() and entry.name != "logs":
            shutil.rmtree(entry, ignore_errors=True)
        elif not entry.is_dir():
            entry.unlink(missing_ok=True)
    progress(f"the logs are kept in {workdir / 'logs'}")


def check_cache_dir() -> None:
    """Where the default model is converted (``KVMESH_CACHE_DIR``, else ~/.cache/kvmesh) can be written."""
    from kvmesh.engine.loader.default_model import cache_dir

    path = cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as exc:
        raise UpUsageError(f"the model cache {path} (KVMESH_CACHE_DIR) is not writable: {exc.strerror or exc}") from None


def check_api_key_file(path: str | None) -> None:
    if path is None:
        return
    from kvmesh.services.router.api_keys import ApiKeyError, load_api_keys

    try:
        if load_api_keys(path, env={}) is None:
            raise UpUsageError(f"--api-key-file {path} holds no key")
    except ApiKeyError as exc:
        raise UpUsageError(f"--api-key-file: {exc}") from None


def check_service_args(args: argparse.Namespace) -> None:
    """What the services would refuse at start, refused now."""
    if args.rate_limits is not None:
        from kvmesh.services.router.rate_limits import RateLimitConfigError, load_rate_limits

        try:
            load_rate_limits(args.rate_limits)
        except RateLimitConfigError as exc:
            raise UpUsageError(f"--rate-limits: {exc}") from None
    if args.routing_config is not None:
        from kvmesh.routing.scorer import load_scorer_config

        try:
            load_scorer_config(args.routing_config)
        except (OSError, ValueError) as exc:
            raise UpUsageError(f"--routing-config: {exc}") from None
    if (args.auth_metrics or args.auth_docs) and not (args.api_key_file or env.API_KEY.raw()):
        raise UpUsageError("--auth-metrics / --auth-docs need API keys: give --api-key-file or KVMESH_API_KEY")
    if args.generation_config is not None:
        from kvmesh.services.router.generation_defaults import GenerationDefaults

        problem = GenerationDefaults.setting_problem(args.generation_config)
        if problem is not None:
            raise UpUsageError(problem)
    if args.engine_args is not None:
        from kvmesh.worker.engines import engine_args_problem

        problem = engine_args_problem(args.engine_args)
        if problem is not None:
            raise UpUsageError(problem)
    if args.pin_write_delay is not None and args.pin_write_delay >= args.pin_ttl:
        raise UpUsageError(f"--pin-write-delay must be less than --pin-ttl ({args.pin_ttl}), not {args.pin_write_delay:g}")
    if args.engine != "vllm":
        for flag in VLLM_ONLY:
            if getattr(args, flag.removeprefix("--").replace("-", "_")) is not None:
                raise UpUsageError(f"{flag} is only for vLLM's workers: give --engine vllm, or leave it out")


def check_block_size(args: argparse.Namespace) -> None:
    from kvmesh.worker.engines import block_size_problem

    if args.block_size is not None:
        problem = block_size_problem(args.engine, args.device or "cpu", args.block_size)
        if problem is not None:
            raise UpUsageError(problem)


def check_parallel(args: argparse.Namespace) -> None:
    """Tensor parallel: vLLM workers only, lending no cores
    (``kvmesh.worker.engines.parallel_problem``, as each worker would say it)."""
    problem = parallel_problem_of(args)
    if problem is not None:
        raise UpUsageError(problem)


def check_engine(engine: str) -> None:
    """The workers can host ``engine``: here, or (vLLM) with the Python of .venv-vllm."""
    from kvmesh.worker.engines import worker_python

    try:
        worker_python(engine)
    except ValueError as exc:
        raise UpUsageError(str(exc)) from None


def choose_machine_defaults(args: argparse.Namespace) -> list[str]:
    """The dtype and threads the machine decides where the user did not, and a line saying
    each choice: ``auto`` (the default) is bfloat16 where the CPU (or the CUDA GPU) computes it
    natively, else float32; each worker's threads are its share of the cores this process may use."""
    from kvmesh.machine import default_dtype, threads_per_worker, usable_cores

    said = []
    if args.dtype == "auto":
        device = getattr(args, "device", None) or "cpu"
        args.dtype, why = default_dtype(device)
        said.append(f"dtype {args.dtype}: {why} (--dtype or KVMESH_DTYPE to choose)")
    if args.num_threads is None:  # chosen here, once: the workers are started with it
        workers = args.prefill + args.decode
        args.num_threads = threads_per_worker(workers)
        said.append(
            f"{args.num_threads} thread(s) per worker: {usable_cores()} usable core(s) "
            f"split between {workers} workers (--num-threads to choose)"
        )
    if args.lend_cores is None:
        args.lend_cores = lending_by_default(args)
        if args.lend_cores:
            said.append(
                f"cores lent between idle workers: a worker runs on all {usable_cores()} while the others are idle, "
                f"else on its {args.num_threads} (--no-lend-cores to keep each to its share)"
            )
    return said


def lending_by_default(args: argparse.Namespace) -> bool:
    """Whether the workers lend each other their cores where the user did not say: on the
    CPU, two workers or more, each on a share smaller than the cores, either engine. Measured
    on two cores (docs/benchmarks.md, "Cores lent between idle workers by default"): kvmesh's
    1 + 1 mesh 1.23x at concurrency 1, 0.95x at 8 (within its rounds' spread), 1.05x at 32,
    multi-turn chat 1.01-1.17x in two runs; vLLM's 1 + 1 mesh TTFT 0.67x, multi-turn 1.05x,
    0.98-1.02x under load; both with a higher first-token latency at concurrency 32."""
    from kvmesh.machine import usable_cores

    device = getattr(args, "device", None) or "cpu"
    workers = args.prefill + args.decode
    return device == "cpu" and workers > 1 and args.num_threads < usable_cores() and tensor_parallel_of(args) == 1


def parallel_problem_of(args: argparse.Namespace) -> str | None:
    """What a worker would refuse of the tensor / pipeline parallel settings given
    (flags, else the variables the workers would read)."""
    from kvmesh.settings.worker import EngineSettings
    from kvmesh.worker.engines import parallel_problem

    try:
        size = _given_tensor_parallel(args)
    except env.EnvError as exc:
        return str(exc)
    given = EngineSettings(
        name=args.engine, tensor_parallel_size=size, engine_args=_given_engine_args(args),
        lend_cores="kvmesh up" if args.lend_cores else None, device=getattr(args, "device", None) or "cpu",
    )  # fmt: skip
    return parallel_problem(given)


def tensor_parallel_of(args: argparse.Namespace) -> int:
    """The workers' tensor parallel size, as they will read it (``--engine-args`` last)."""
    from kvmesh.worker.engines import tensor_parallel

    try:
        return tensor_parallel(_given_tensor_parallel(args), _given_engine_args(args))
    except ValueError:
        return 1  # a bad value is refused by check_parallel


def _given_tensor_parallel(args: argparse.Namespace) -> int:
    given = getattr(args, "tensor_parallel_size", None)
    if given is not None:
        return int(given)
    return env.TENSOR_PARALLEL_SIZE.read(positive_int, 1)  # as the workers will: they inherit the environment


def _given_engine_args(args: argparse.Namespace) -> str | None:
    return args.engine_args if args.engine_args is not None else env.ENGINE_ARGS.raw()


def check_args(args: argparse.Namespace) -> Path:
    """Everything that can be checked without starting anything; returns the workdir."""
    check_block_size(args)
    check_parallel(args)
    check_engine(args.engine)
    check_model(args.model, args.engine)
    if args.model is None or args.model == DEFAULT_MODEL or str(args.model).lower().endswith(".gguf"):
        check_cache_dir()  # where the workers convert it
    check_port(args.host, args.port)
    check_api_key_file(args.api_key_file)
    check_service_args(args)
    from kvmesh.infra.servers import find_binary, find_etcd

    find_binary("nats-server")  # missing binaries fail now, not after the model loaded
    find_etcd()
    return check_workdir(args.workdir)  # last: a refused start leaves no folder behind


# -- the run --------------------------------------------------------------------------------
def run_up(args: argparse.Namespace) -> int:
    chosen = choose_machine_defaults(args)
    workdir = check_args(args)
    for line in chosen:
        progress(line)
    from kvmesh.infra.local_mesh import ONE_PROCESS_VARIABLES

    for name in ONE_PROCESS_VARIABLES:
        if os.environ.get(name):
            progress(f"{name} ignored: it names one process, and kvmesh up runs several (each picks its own)")
    from kvmesh.infra.local_mesh import LocalMesh, MeshOptions

    router_args, worker_args, env = service_args(args)

    mesh = LocalMesh(
        MeshOptions(
            prefill=args.prefill,
            decode=args.decode,
            host=args.host,
            port=args.port,
            model=args.model,
            engine=args.engine,
            dtype=args.dtype,
            kv_cache_mib=args.kv_cache_mib,
            block_size=args.block_size,
            num_threads=args.num_threads,
            prefix_caching=not args.no_prefix_caching,
            lend_cores=bool(args.lend_cores),
            routing_config=str(Path(args.routing_config).expanduser().resolve()) if args.routing_config else None,
            lease_ttl=args.lease_ttl,
            pin_ttl=args.pin_ttl,
            request_timeout=args.request_timeout,
            router_args=router_args,
            worker_args=worker_args,
            env=env,
            api_key_file=str(Path(args.api_key_file).expanduser().resolve()) if args.api_key_file else None,
            tls=args.tls,
            supervise=True,
        ),
        workdir,
    )
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise _Stopped(signum)
        progress(f"{signal.Signals(signum).name} again: killing what is left")
        mesh.hurry()

    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    stopped_as_asked = False
    try:
        mesh.start(progress)
        print(f"kvmesh is serving at {mesh.base_url}/v1   (logs: {workdir / 'logs'}; Ctrl-C stops)", flush=True)
        while True:
            signal.pause()  # the supervisor thread keeps the children alive meanwhile
    except _Stopped as stop:
        progress(f"{signal.Signals(stop.args[0]).name}: stopping")
        stopped_as_asked = True
        return 0
    finally:
        stopping = True  # a signal from here on hurries the stop instead of cutting it short
        mesh.stop()
        progress("stopped")
        if args.workdir is None:  # its own temporary folder: credentials, CA, server data, logs
            forget_workdir(workdir, keep_logs=not stopped_as_asked)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
