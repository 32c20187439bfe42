"""A whole mesh on one machine: nats-server, etcd, the router and the workers, each its own
process. ``kvmesh up`` runs one; the end-to-end tests run one per module.

With ``MeshOptions.supervise`` (``kvmesh up`` sets it) a child that dies is started again
with backoff (``supervisor``): a worker keeps its id, nats-server and etcd their ports and
data, the router its port; a dead worker's etcd record is deleted at once. Without it (the
default, for fault tests) a killed child stays dead. Every child gets ``PR_SET_PDEATHSIG``,
and ``pids.json`` in the workdir names them all while the mesh runs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvmesh.engine.core_lending import CoreLending
from kvmesh.infra.credentials import MeshCredentials
from kvmesh.security.nats_permissions import DEFAULT_REQUEST_DEADLINE
from kvmesh.infra.processes import ManagedProcess, ProcessStartError, stop_all
from kvmesh.infra.servers import ETCD_READY, NATS_READY, EtcdServer, NatsServer, start_etcd, start_nats
from kvmesh.infra.supervisor import RestartPolicy, Supervised, Supervisor
from kvmesh.machine import threads_per_worker
from kvmesh.security.tls import LOCAL_HOSTS, MeshTLS

logger = logging.getLogger(__name__)

ROUTER_READY = re.compile(r"router listening on (http://\S+)")
KV_METADATA_READY = "kv-metadata kv-metadata ready"


@dataclass
class MeshOptions:
    prefill: int = 1
    decode: int = 1
    kv_metadata: bool = True  # the cluster KV index (KV-aware routing uses it)
    prefix_caching: bool = True
    routing_config: str | None = None
    auth: bool = True  # NATS users and etcd roles with fresh passwords (``infra.credentials``); off: anonymous
    tls: bool = False  # NATS and etcd over TLS only, with a fresh CA (``security.tls``); ``kvmesh up`` turns it on
    port: int = 0  # the router's; 0 picks a free one
    host: str = "127.0.0.1"
    model: str | None = None
    engine: str = "kvmesh"  # what every worker hosts (``kvmesh.worker.engines``)
    dtype: str = "float32"
    kv_cache_mib: int = 256
    block_size: int | None = None  # None: the engine's default (``kvmesh.worker.engines.DEFAULT_BLOCK_SIZE``)
    namespace: str = "default"
    lease_ttl: int = 5
    pin_ttl: int = 30
    num_threads: int | None = None  # per worker; None: the cores split between workers
    lend_cores: bool = False  # the workers' engines lend each other their cores while idle (``engine.core_lending``)
    request_timeout: float = 30.0
    api_key: str | None = None  # written to a 0600 file in the workdir; the router gets its path, never the key
    api_key_file: str | None = None  # the router's --api-key-file (KVMESH_API_KEY passes through the environment)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every service
    router_args: list[str] = field(default_factory=list)  # more flags for the router (``kvmesh up`` forwards its own)
    worker_args: list[str] = field(default_factory=list)  # more flags for every worker
    ready_timeout: float = 300.0
    supervise: bool = False  # restart children that die (kvmesh up); off: a killed child stays dead
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    stop_grace: float = 5.0  # seconds each stage of stop() waits after SIGTERM before SIGKILL


# A service whose parent died goes at once: nats-server and etcd go with it, so a drain has
# nothing left to drain into. (With SIGTERM a decode worker once stayed past 60 s, its drain
# not even begun, on a quiet machine: a signal a blocked event loop never read.)
SERVICE_DEATH_SIGNAL = signal.SIGKILL
SERVER_DEATH_SIGNAL = signal.SIGKILL  # nats-server and etcd have nothing to drain
# Variables that name one process (its health port, its id): the mesh runs several services,
# each with its own (a fixed health port would be taken by the first and refused to the rest).
# each names one process: a worker's cores (its board slot, its bound cores) included
ONE_PROCESS_VARIABLES = (
    "KVMESH_HEALTH_PORT", "KVMESH_WORKER_ID", "KVMESH_SERVICE_ID", "KVMESH_IDENTITY_SLOTS", "KVMESH_LEND_CORES", "KVMESH_CPU_BIND",
)  # fmt: skip
LENDING_SLOTS = 64  # workers of a mesh on one core-lending board; later ones keep to their share


def _says_ready(worker_id: str, text: str) -> bool:
    return f"worker {worker_id} ready" in text


def cpu_bind(index: int, threads: int) -> str:
    """The cores of the ``index``-th worker's ``threads`` threads, among those this process
    may run on, round robin (as ``VLLM_CPU_OMP_THREADS_BIND`` takes them: ``"0,1"``)."""
    cores = sorted(os.sched_getaffinity(0))
    return ",".join(str(cores[(index * threads + i) % len(cores)]) for i in range(min(threads, len(cores))))


class LocalMesh:
    def __init__(self, options: MeshOptions, workdir: Path) -> None:
        self.options = options
        self.workdir = workdir
        self.nats: NatsServer | None = None
        self.etcd: EtcdServer | None = None
        self.router: ManagedProcess | None = None
        self.kv_metadata: ManagedProcess | None = None
        self.workers: dict[str, ManagedProcess] = {}  # by worker id
        self.base_url = ""
        self._count = 0
        self._lending_board: Path | None = None  # ``MeshOptions.lend_cores``: made with the first worker
        self._lending_slots: dict[str, int] = {}  # each worker's byte on it
        self._roles: dict[str, str] = {}  # worker id -> role
        self._supervisor: Supervisor | None = None
        self._report: Callable[[str], None] = lambda message: None
        self._pids_lock = threading.Lock()
        self._hurry = False
        self.credentials: MeshCredentials | None = None
        self.tls: MeshTLS | None = None
        self._bind_guard: Path | Literal[False] | None = None  # None: not built yet; False: cannot be

    @property
    def pids_path(self) -> Path:
        return self.workdir / "pids.json"

    # -- start ---------------------------------------------------------------------------
    def start(self, progress: Callable[[str], None] = lambda message: None) -> None:
        """Start everything and wait until the router is healthy; ``progress`` gets a line
        per step (and, when supervised, one per exit, restart and recovery)."""
        self._report = progress
        try:
            self._start(progress)
            if self.options.supervise:
                self._supervise()
        except BaseException:
            self.stop()
            raise

    def _start(self, progress: Callable[[str], None]) -> None:
        opts = self.options
        progress("preparing the model")
        from kvmesh.engine.loader.default_model import resolve_model

        resolve_model(opts.model)  # convert once here, not in every worker at the same time
        progress("starting nats-server and etcd")
        if opts.auth:
            planned = {f"{role}-{self._count + i + 1}": role for i, role in enumerate(["prefill"] * opts.prefill + ["decode"] * opts.decode)}
            self.credentials = MeshCredentials.generate(
                self.workdir / "auth", opts.namespace, planned, "kv-metadata", request_deadline=self._request_deadline()
            )
        if opts.tls:
            self.tls = MeshTLS.generate(self.workdir / "tls", {"nats": LOCAL_HOSTS, "etcd": LOCAL_HOSTS})
        auth = self.credentials
        self.nats = start_nats(
            self.workdir, parent_death_signal=SERVER_DEATH_SIGNAL,
            config=auth.nats_config if auth else None, admin=auth.nats_admin if auth else None, tls=self.tls,
        )  # fmt: skip
        self._write_pids()
        self.etcd = start_etcd(self.workdir, parent_death_signal=SERVER_DEATH_SIGNAL, tls=self.tls)
        if auth is not None:
            self.etcd.enable_auth(auth.etcd_root_password, auth.etcd_users)
        self._write_pids()
        if opts.kv_metadata:
            progress("starting kv-metadata")
            self.kv_metadata = self._spawn(
                "kv-metadata", [sys.executable, "-m", "kvmesh.services.kv_metadata", *self._mesh_args("kv-metadata"), "--service-id", "kv-metadata"]
            )
            self._write_pids()
            self.kv_metadata.wait_for_line(lambda text: KV_METADATA_READY in text, opts.ready_timeout)
        progress(f"starting {opts.prefill} prefill and {opts.decode} decode worker(s); loading the model")
        pending = [self.start_worker("prefill") for _ in range(opts.prefill)]
        pending += [self.start_worker("decode") for _ in range(opts.decode)]
        for worker_id in pending:
            self.wait_worker_ready(worker_id)
            progress(f"worker {worker_id} ready")
        progress("starting the router")
        self.router = self._spawn("router", self._router_argv(opts.port))
        self._write_pids()
        line = self.router.wait_for_line(lambda text: ROUTER_READY.search(text) is not None, opts.ready_timeout)
        match = ROUTER_READY.search(line)
        assert match is not None
        self.base_url = match.group(1)
        self._wait_healthy(opts.ready_timeout)
        self._write_pids()
        progress(f"ready at {self.base_url}/v1")

    # -- supervision ---------------------------------------------------------------------
    def _supervise(self) -> None:
        assert self.nats is not None and self.etcd is not None and self.router is not None
        supervisor = Supervisor(self.options.restart, report=self._report, on_change=self._write_pids)
        nats, etcd = self.nats, self.etcd
        supervisor.watch("nats-server", nats.process, nats.respawn, tier=2, ready=lambda t: NATS_READY.search(t) is not None)
        supervisor.watch("etcd", etcd.process, etcd.respawn, tier=2, ready=lambda text: ETCD_READY in text)
        if self.kv_metadata is not None:
            supervisor.watch(
                "kv-metadata", self.kv_metadata, self._respawn_kv_metadata, tier=1,
                ready=lambda text: KV_METADATA_READY in text, on_exit=self._deregister,
            )  # fmt: skip
        for worker_id in self.workers:
            supervisor.watch(
                worker_id, self.workers[worker_id], functools.partial(self._respawn_worker, worker_id), tier=1,
                ready=functools.partial(_says_ready, worker_id), on_exit=self._worker_exited,
            )  # fmt: skip
        port = int(self.base_url.rsplit(":", 1)[1])  # a restarted router keeps the URL
        supervisor.watch(
            "router", self.router, lambda: self._respawn_router(port), tier=0,
            ready=lambda text: ROUTER_READY.search(text) is not None,
        )  # fmt: skip
        self._supervisor = supervisor
        supervisor.start()

    def _respawn_worker(self, worker_id: str) -> ManagedProcess:
        self.workers[worker_id] = self.workers[worker_id].respawn()
        return self.workers[worker_id]

    def _respawn_kv_metadata(self) -> ManagedProcess:
        assert self.kv_metadata is not None
        self.kv_metadata = self.kv_metadata.respawn()
        return self.kv_metadata

    def _respawn_router(self, port: int) -> ManagedProcess:
        assert self.router is not None
        self.router = self.router.respawn(self._router_argv(port))
        return self.router

    def _worker_exited(self, child: Supervised) -> None:
        self._idle_on_the_board(child.name)
        self._deregister(child)

    def _idle_on_the_board(self, worker_id: str) -> None:
        """A dead worker's byte on the lending board back to idle now, not when its restart has
        loaded the model: the other workers neither keep to their share nor wait ``HANDOVER``
        each time they turn busy for a borrower that is gone."""
        slot = self._lending_slots.get(worker_id)
        if self._lending_board is None or slot is None:
            return
        try:
            CoreLending.mark_idle(self._lending_board, slot)
        except OSError as exc:
            logger.warning("could not mark %s idle on the lending board: %s", worker_id, exc)

    def _deregister(self, child: Supervised) -> None:
        """Delete a dead worker's etcd record now, so nobody waits out its lease."""
        from kvmesh.protocol import Keys  # imports torch: not needed before a death

        if self.etcd is None:
            return
        role = "kv-metadata" if child.name == "kv-metadata" else self._roles[child.name]
        if self.etcd.delete_key(Keys(self.options.namespace).worker(role, child.name)):
            logger.info("deleted the etcd record of %s", child.name)

    def pids(self) -> dict[str, int]:
        """The PID of every child now running, by name."""
        processes = {
            "nats-server": self.nats.process if self.nats else None,
            "etcd": self.etcd.process if self.etcd else None,
            "kv-metadata": self.kv_metadata,
            **self.workers,
            "router": self.router,
        }
        return {name: p.pid for name, p in processes.items() if p is not None and p.is_running()}

    def _write_pids(self) -> None:
        """``pids.json``: this process, its children and the URLs, replaced atomically."""
        info = {
            "pid": os.getpid(),
            "processes": self.pids(),
            "base_url": self.base_url or None,
            "nats_url": self.nats.url if self.nats else None,
            "etcd": self.etcd.endpoint if self.etcd else None,
            "tls_ca": str(self.tls.ca_file) if self.tls else None,  # NATS (handshake first) and etcd trust it
        }
        with self._pids_lock:
            self.workdir.mkdir(parents=True, exist_ok=True)
            temporary = self.pids_path.with_suffix(".json.tmp")
            temporary.write_text(json.dumps(info, indent=2) + "\n")
            temporary.chmod(0o600)  # the URLs carry the admin's credentials when auth is on
            os.replace(temporary, self.pids_path)

    def _request_deadline(self) -> float:
        """The services' request deadline (they read it from the environment), which bounds
        how long a worker's credentials may answer a piece of work."""
        value = self._env().get("KVMESH_REQUEST_DEADLINE")
        try:
            return float(value) if value else DEFAULT_REQUEST_DEADLINE
        except ValueError:
            raise ValueError(f"KVMESH_REQUEST_DEADLINE is not a number of seconds: {value!r}") from None

    def _env(self) -> dict[str, str]:
        env = {name: value for name, value in os.environ.items() if name not in ONE_PROCESS_VARIABLES}
        env.update(self.options.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _mesh_args(self, identity: str) -> list[str]:
        """Where the mesh is, and the path of ``identity``'s credentials file when auth is on."""
        assert self.nats is not None and self.etcd is not None
        argv = [
            "--nats-url", self.nats.address,
            "--etcd", self.etcd.address,
            "--namespace", self.options.namespace,
            "--request-timeout", str(self.options.request_timeout),
        ]  # fmt: skip
        if self.credentials is not None:
            path = str(self.credentials.file_of(identity))
            argv += ["--nats-credentials", path, "--etcd-credentials", path]
        if self.tls is not None:
            argv += ["--nats-tls-ca", str(self.tls.ca_file), "--etcd-tls-ca", str(self.tls.ca_file)]
            if self.credentials is not None:  # everything is there: a service missing any of it refuses to start
                argv.append("--require-tls")
        return argv

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
        return ManagedProcess(
            name,
            argv,
            log_path=self.workdir / "logs" / f"{name}.log",
            env=env or self._env(),
            parent_death_signal=SERVICE_DEATH_SIGNAL,
        )

    def _router_argv(self, port: int) -> list[str]:
        opts = self.options
        argv = [sys.executable, "-m", "kvmesh.services.router", *self._mesh_args("router"), "--host", opts.host, "--port", str(port)]
        if opts.model:
            argv += ["--model", opts.model]
        if opts.api_key or opts.api_key_file:
            argv += ["--api-key-file", self._api_key_file()]
        if opts.routing_config:
            argv += ["--routing-config", opts.routing_config]
        return argv + opts.router_args

    def _api_key_file(self) -> str:
        if self.options.api_key_file:
            return self.options.api_key_file
        path = self.workdir / "api_keys"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(f"default:{self.options.api_key}\n")
        os.chmod(path, 0o600)
        return str(path)

    def start_worker(self, role: str, extra_args: Sequence[str] = ()) -> str:
        """Start one more worker process (``extra_args``: flags of its own, after the mesh's);
        returns its id (wait with ``wait_worker_ready``)."""
        opts = self.options
        self._count += 1
        worker_id = f"{role}-{self._count}"
        self._roles[worker_id] = role
        threads = opts.num_threads or threads_per_worker(opts.prefill + opts.decode)
        from kvmesh.worker.engines import DEFAULT_BLOCK_SIZE, worker_python

        argv = [
            worker_python(opts.engine), "-m", f"kvmesh.services.{role}_worker", *self._mesh_args(worker_id),
            "--worker-id", worker_id,
            "--engine", opts.engine,
            "--dtype", opts.dtype,
            "--kv-cache-mib", str(opts.kv_cache_mib),
            "--block-size", str(opts.block_size or DEFAULT_BLOCK_SIZE[opts.engine]),
            "--lease-ttl", str(opts.lease_ttl),
            "--pin-ttl", str(opts.pin_ttl),
            "--num-threads", str(threads),
        ]  # fmt: skip
        if opts.model:
            argv += ["--model", opts.model]
        if not opts.prefix_caching:
            argv.append("--no-prefix-caching")
        if opts.lend_cores and self._count <= LENDING_SLOTS:
            if self._lending_board is None:  # a fresh one: a workdir's earlier board may hold its dead workers busy
                self._lending_board = self.workdir / "cores"
                CoreLending.create(self._lending_board, LENDING_SLOTS)
            argv += ["--lend-cores", f"{self._lending_board}:{self._count - 1}"]
            self._lending_slots[worker_id] = self._count - 1
        elif opts.engine == "vllm":  # each worker's OpenMP threads on cores of their own, round robin
            argv += ["--cpu-bind", cpu_bind(self._count - 1, threads)]
        argv += [*opts.worker_args, *extra_args]
        self.workers[worker_id] = self._spawn(worker_id, argv, self._worker_env())
        self._write_pids()
        return worker_id

    def _worker_env(self) -> dict[str, str]:
        """A worker's environment: the bind guard already preloaded when it can be built, so
        the worker need not execute itself again to load it (``transfer.bind_guard``)."""
        from kvmesh.transfer import bind_guard

        env = self._env()
        if self._bind_guard is None:
            self._bind_guard = bind_guard.library() or False
        return bind_guard.preload_env(self._bind_guard, env) if self._bind_guard else env

    def wait_worker_ready(self, worker_id: str) -> None:
        self.workers[worker_id].wait_for_line(
            lambda text: f"worker {worker_id} ready" in text, self.options.ready_timeout
        )

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError, json.JSONDecodeError):
                pass
            if self.router is not None and not self.router.is_running():
                raise ProcessStartError(f"the router exited:\n{self.router.tail()}")
            if time.monotonic() > deadline:
                raise ProcessStartError(f"the router did not become healthy in {timeout:.0f}s")
            time.sleep(0.1)

    # -- stop ----------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop everything this mesh started, by PID, each stage all at once: the router
        first (it ends open streams with an error event and ``[DONE]``), then the workers
        and kv-metadata, then etcd and nats-server. Nothing is restarted from here on."""
        if self._supervisor is not None:
            self._supervisor.close()
        grace = self.options.stop_grace
        hurry = lambda: self._hurry  # noqa: E731
        stop_all([self.router] if self.router is not None else [], grace, hurry=hurry)
        stop_all([*self.workers.values(), *([self.kv_metadata] if self.kv_metadata else [])], grace, hurry=hurry)
        stop_all([s.process for s in (self.etcd, self.nats) if s is not None], grace, hurry=hurry)
        if self._supervisor is not None:
            self._supervisor.join()  # only now: its restarted children were tied to its thread
        self.pids_path.unlink(missing_ok=True)

    def hurry(self) -> None:
        """Make a stop in progress SIGKILL what is left now (a second Ctrl-C)."""
        self._hurry = True
