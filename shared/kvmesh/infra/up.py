"""``kvmesh up``: check the arguments at once, run a supervised ``LocalMesh``, stop it on a
signal.

Bad arguments (a busy port, a missing model path, ...) are found before anything starts and
reported on one line with exit code 2. SIGINT, SIGTERM and SIGHUP stop the whole mesh (exit
0); a second one during the stop SIGKILLs what is left. While serving, a child that dies is
restarted (``supervisor``); the mesh stops only on the user's signal.
"""

from __future__ import annotations

import argparse
import errno
import signal
import socket
import sys
import tempfile
from pathlib import Path

from kvmesh.errors import KvmeshError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # the loader's name for it (importing the loader takes a while)


class UpUsageError(KvmeshError):
    """A bad argument, found before anything started."""


class _Stopped(BaseException):
    """The user's signal, raised in the main thread (wherever start had got to)."""


def progress(message: str) -> None:
    sys.stderr.write(f"kvmesh up: {message}\n")
    sys.stderr.flush()


# -- checks, all before anything starts ---------------------------------------------------
def check_model(model: str | None) -> None:
    if model is None or model == DEFAULT_MODEL:
        return
    path = Path(model).expanduser()
    if not path.exists():
        raise UpUsageError(f"model path {model} does not exist")
    if path.is_dir() and not (path / "config.json").is_file():
        raise UpUsageError(f"model directory {model} has no config.json")
    if not path.is_dir() and path.suffix.lower() != ".gguf":
        raise UpUsageError(f"model {model} is neither a model directory nor a .gguf file")


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


def check_workdir(workdir: str | None) -> Path:
    if workdir is None:
        return Path(tempfile.mkdtemp(prefix="kvmesh-up-"))
    path = Path(workdir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UpUsageError(f"--workdir {workdir}: {exc.strerror or exc}") from None
    return path


def check_api_key_file(path: str | None) -> None:
    if path is None:
        return
    from kvmesh.services.router.api_keys import ApiKeyError, load_api_keys

    try:
        if load_api_keys(path, env={}) is None:
            raise UpUsageError(f"--api-key-file {path} holds no key")
    except ApiKeyError as exc:
        raise UpUsageError(f"--api-key-file: {exc}") from None


def check_engine(engine: str) -> None:
    """The workers can host ``engine``: here, or (vLLM) with the Python of .venv-vllm."""
    from kvmesh.worker.engines import worker_python

    try:
        worker_python(engine)
    except ValueError as exc:
        raise UpUsageError(str(exc)) from None


def check_args(args: argparse.Namespace) -> Path:
    """Everything that can be checked without starting anything; returns the workdir."""
    check_engine(args.engine)
    check_model(args.model)
    check_port(args.host, args.port)
    workdir = check_workdir(args.workdir)
    check_api_key_file(args.api_key_file)
    from kvmesh.infra.servers import find_binary, find_etcd

    find_binary("nats-server")  # missing binaries fail now, not after the model loaded
    find_etcd()
    return workdir


# -- the run --------------------------------------------------------------------------------
def run_up(args: argparse.Namespace) -> int:
    workdir = check_args(args)
    from kvmesh.infra.local_mesh import LocalMesh, MeshOptions

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
    try:
        mesh.start(progress)
        print(f"kvmesh is serving at {mesh.base_url}/v1   (logs: {workdir / 'logs'}; Ctrl-C stops)", flush=True)
        while True:
            signal.pause()  # the supervisor thread keeps the children alive meanwhile
    except _Stopped as stop:
        progress(f"{signal.Signals(stop.args[0]).name}: stopping")
        return 0
    finally:
        stopping = True  # a signal from here on hurries the stop instead of cutting it short
        mesh.stop()
        progress("stopped")
        for signum, handler in previous.items():
            signal.signal(signum, handler)
