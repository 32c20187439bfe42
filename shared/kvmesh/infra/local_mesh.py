"""A whole mesh on one machine: nats-server, etcd, the router and the workers, each its own
process. ``kvmesh up`` runs one; the end-to-end tests run one per module."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.infra.processes import ManagedProcess, ProcessStartError
from kvmesh.infra.servers import EtcdServer, NatsServer, start_etcd, start_nats

logger = logging.getLogger(__name__)

ROUTER_READY = re.compile(r"router listening on (http://\S+)")


@dataclass
class MeshOptions:
    prefill: int = 1
    decode: int = 1
    kv_metadata: bool = True  # the cluster KV index (KV-aware routing uses it)
    prefix_caching: bool = True
    routing_config: str | None = None
    port: int = 0  # the router's; 0 picks a free one
    host: str = "127.0.0.1"
    model: str | None = None
    dtype: str = "float32"
    kv_cache_mib: int = 256
    block_size: int = 16
    namespace: str = "default"
    lease_ttl: int = 5
    pin_ttl: int = 30
    num_threads: int | None = None  # per worker; None: the cores split between workers
    request_timeout: float = 30.0
    api_key: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every service
    ready_timeout: float = 300.0


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

    # -- start ---------------------------------------------------------------------------
    def start(self, progress: Callable[[str], None] = lambda message: None) -> None:
        try:
            self._start(progress)
        except BaseException:
            self.stop()
            raise

    def _start(self, progress: Callable[[str], None]) -> None:
        opts = self.options
        progress("preparing the model")
        from kvmesh.engine.loader.default_model import resolve_model

        resolve_model(opts.model)  # convert once here, not in every worker at the same time
        progress("starting nats-server and etcd")
        self.nats = start_nats(self.workdir)
        self.etcd = start_etcd(self.workdir)
        if opts.kv_metadata:
            progress("starting kv-metadata")
            self.kv_metadata = self._spawn(
                "kv-metadata", [sys.executable, "-m", "kvmesh.services.kv_metadata", *self._mesh_args(), "--service-id", "kv-metadata"]
            )
            self.kv_metadata.wait_for_line(lambda text: "kv-metadata kv-metadata ready" in text, opts.ready_timeout)
        progress(f"starting {opts.prefill} prefill and {opts.decode} decode worker(s); loading the model")
        pending = [self.start_worker("prefill") for _ in range(opts.prefill)]
        pending += [self.start_worker("decode") for _ in range(opts.decode)]
        for worker_id in pending:
            self.wait_worker_ready(worker_id)
            progress(f"worker {worker_id} ready")
        progress("starting the router")
        self.router = self._spawn("router", self._router_argv())
        line = self.router.wait_for_line(lambda text: ROUTER_READY.search(text) is not None, opts.ready_timeout)
        match = ROUTER_READY.search(line)
        assert match is not None
        self.base_url = match.group(1)
        self._wait_healthy(opts.ready_timeout)
        progress(f"ready at {self.base_url}/v1")

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.options.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _mesh_args(self) -> list[str]:
        assert self.nats is not None and self.etcd is not None
        return [
            "--nats-url", self.nats.url,
            "--etcd", self.etcd.endpoint,
            "--namespace", self.options.namespace,
            "--request-timeout", str(self.options.request_timeout),
        ]  # fmt: skip

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        return ManagedProcess(name, argv, log_path=self.workdir / "logs" / f"{name}.log", env=self._env())

    def _router_argv(self) -> list[str]:
        opts = self.options
        argv = [sys.executable, "-m", "kvmesh.services.router", *self._mesh_args(), "--host", opts.host, "--port", str(opts.port)]
        if opts.model:
            argv += ["--model", opts.model]
        if opts.api_key:
            argv += ["--api-key", opts.api_key]
        if opts.routing_config:
            argv += ["--routing-config", opts.routing_config]
        return argv

    def start_worker(self, role: str) -> str:
        """Start one more worker process; returns its id (wait with ``wait_worker_ready``)."""
        opts = self.options
        self._count += 1
        worker_id = f"{role}-{self._count}"
        threads = opts.num_threads or max(1, (os.cpu_count() or 2) // max(1, opts.prefill + opts.decode))
        argv = [
            sys.executable, "-m", f"kvmesh.services.{role}_worker", *self._mesh_args(),
            "--worker-id", worker_id,
            "--dtype", opts.dtype,
            "--kv-cache-mib", str(opts.kv_cache_mib),
            "--block-size", str(opts.block_size),
            "--lease-ttl", str(opts.lease_ttl),
            "--pin-ttl", str(opts.pin_ttl),
            "--num-threads", str(threads),
        ]  # fmt: skip
        if opts.model:
            argv += ["--model", opts.model]
        if not opts.prefix_caching:
            argv.append("--no-prefix-caching")
        self.workers[worker_id] = self._spawn(worker_id, argv)
        return worker_id

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
        """Stop everything this mesh started, by PID: router, workers, then the servers."""
        if self.router is not None:
            self.router.stop()
        for process in self.workers.values():
            process.stop(grace=15)
        if self.kv_metadata is not None:
            self.kv_metadata.stop()
        for server in (self.etcd, self.nats):
            if server is not None:
                server.stop()
