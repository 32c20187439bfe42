"""The host of one worker's engine: NATS, etcd registration, the transfer engine, load
reports, pool stats, cancellation, health checks, heartbeats, and drain on SIGTERM.
Role-specific work lives in the services; this is what they share.

An engine that stops (its thread failed) ends the process with a non-zero exit code, so a
supervisor restarts it: never a live process with a dead engine."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import nats
from nats.aio.msg import Msg

from kvmesh.cluster.connect import connect_mesh
from kvmesh.cluster.directory import WorkerDirectory
from kvmesh.cluster.etcd_store import EtcdStore
from kvmesh.cluster.registration import LeasedKey
from kvmesh.metrics.worker import WorkerMetrics
from kvmesh.protocol import CancelRequest, Keys, KVLayoutSpec, LoadReport, Stage, Subjects, WorkerRecord, WorkerStats
from kvmesh.service_main import running_as_service, until_signalled
from kvmesh.settings.worker import WorkerSettings
from kvmesh.telemetry import shutdown_tracing, tracer
from kvmesh.transfer import bind_guard
from kvmesh.transfer.layout import PoolLayout
from kvmesh.transfer.mooncake_agent import MooncakeAgent
from kvmesh.worker.callbacks import ControlHandlers
from kvmesh.worker.engine_api import Engine
from kvmesh.worker.engines import create_engine, preload, unavailable
from kvmesh.worker.health import HealthServer, HealthStatus
from kvmesh.worker.heartbeat import Heartbeat
from kvmesh.worker.kv_events import KVEventPublisher
from kvmesh.tasks import pause

logger = logging.getLogger(__name__)


class WorkerRuntime:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        self.subjects = Subjects(settings.mesh.namespace)
        self.keys = Keys(settings.mesh.namespace)
        self.timeout = settings.mesh.request_timeout
        self.tracer = tracer(f"kvmesh.{settings.role}")
        self.engine: Engine
        self.agent: MooncakeAgent
        self.nc: nats.NATS
        self.store: EtcdStore
        self.registration: LeasedKey | None = None
        self.slot: Any = None  # the IdentitySlot this worker runs as, with identity slots
        self._started_at = time.time()
        self.draining = False
        self.bytes_served = 0  # prefill: bytes of pinned blocks peers pulled
        self.pin_count: Callable[[], int] = lambda: 0
        # requests queued before the engine, reported as waiting with the engine's own (a decode
        # worker's pulls waiting for room): the router sees the whole queue
        self.queued_outside_engine: Callable[[], int] = lambda: 0
        self.on_cancel: Callable[[str], Awaitable[None]] = self._abort
        self._tasks: set[asyncio.Task] = set()
        self._work_subscriptions: list[Any] = []
        self._background: list[asyncio.Task] = []
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._stopped = asyncio.Event()
        self.exit_code = 0  # non-zero once the engine has died
        self.directory: WorkerDirectory | None = None  # every worker's record, to check handles against
        self.control = ControlHandlers()  # cancels, releases, lends: off their NATS callbacks
        self.health = HealthServer(self.health_status, settings.health_host, settings.health_port)
        self.metrics: WorkerMetrics | None = None  # once the engine is loaded: /metrics on the health port

    # -- start ---------------------------------------------------------------------------
    async def prepare(self) -> WorkerSettings:
        """What comes before the settings are logged (``kvmesh.service_main.start_service``):
        the transfer engine's listeners on the advertised address only (``bind_guard``; in a
        service process this executes it again, same PID, with the guard preloaded), then,
        with identity slots, the identity claimed (``kvmesh.cluster.identity_slots``).
        Returns the settings the worker runs with."""
        s = self.settings
        bind_guard.enforce(s.advertise_host, s.transfer_port_range, reexec=running_as_service())
        if s.identity_slots:  # run as one of the role's identities no live worker holds
            if unavailable(s.engine.name) is None:  # torch imported before the lease, not while it must be kept
                await asyncio.to_thread(preload, s.engine.name)
            return await self._claim_identity()
        return self.settings

    def _register_pool(self, pool: PoolLayout) -> None:
        """Register the KV pool with the transfer engine: one range, or each separately
        allocated layer's, or each rank's of a pool split across vLLM's tensor-parallel
        processes (mapped here: ``kvmesh.worker.shared_pool``). Blocks while it registers:
        run it off the event loop."""
        for address, nbytes in pool.regions():
            self.agent.register(address, nbytes)

    async def start(self) -> None:
        """Once the service has started (``start_service``, ``prepare`` first)."""
        s = self.settings
        await self.health.start()  # live (and not ready) while the model loads
        logger.info("loading the model")
        self.engine = await create_engine(s.engine)
        metrics = self.metrics = WorkerMetrics(self.engine.model_name, s.role, self.worker_id)
        self.engine.observe_steps(metrics)
        self.health.metrics = functools.partial(metrics.render, self.engine, lambda: self.queued_outside_engine())
        pool = self.engine.kv_layout
        # Off the event loop: the engine's start may wait on this host's start lock (other
        # workers' engines starting), and the identity slot's lease must be kept meanwhile.
        self.agent = await asyncio.to_thread(MooncakeAgent, s.advertise_host, port_range=s.transfer_port_range)
        await asyncio.to_thread(self._register_pool, pool)
        self._background.append(asyncio.create_task(self._watch_engine(), name="engine-watch"))
        self.nc, self.store = await connect_mesh(s.mesh, f"{s.role}-{self.worker_id}")
        self.directory = WorkerDirectory(self.store, self.keys)
        await self.directory.start()
        await self.nc.subscribe(self.subjects.cancel, cb=self.control.wrap(self._handle_cancel))
        self.on_close(self.control.close)
        await self.nc.subscribe(self.subjects.stats(self.worker_id), cb=self._handle_stats)
        self._background.append(asyncio.create_task(self._report_load(), name="load-reports"))
        self.kv_events = KVEventPublisher(
            self.engine, self.nc, self.subjects, self.worker_id, on_snapshot=metrics.snapshot_answered
        )
        await self.kv_events.start()
        self.on_close(self.kv_events.stop)

    async def _claim_identity(self) -> WorkerSettings:
        from kvmesh.cluster.identity_slots import NO_FREE_SLOT_EXIT, IdentitySlot, SlotError

        try:
            self.slot = await IdentitySlot.claim(self.settings)
        except SlotError as exc:
            logger.error("%s; exiting (code %d) to be started again later", exc, NO_FREE_SLOT_EXIT)
            raise SystemExit(NO_FREE_SLOT_EXIT) from None

        def lost() -> None:  # another worker runs as this identity now: stop, to be started again
            self.exit_code = 1
            self._stopped.set()

        self.slot.keep(on_lost=lost)
        self.on_close(self.slot.release)  # first registered, so closed last
        self.settings = self.slot.settings(self.settings)
        self.worker_id = self.settings.worker_id
        return self.settings

    async def abandon_identity(self) -> None:
        """A start that failed after the claim frees the identity now, not at its lease's end."""
        if self.slot is not None:
            await self.slot.release()
            self.slot = None

    def record(self) -> WorkerRecord:
        engine = self.engine
        role_subject = self.subjects.prefill if self.settings.role == "prefill" else self.subjects.decode
        return WorkerRecord(
            worker_id=self.worker_id,
            role=self.settings.role,
            model=engine.model_name,
            max_model_len=engine.max_model_len,
            subject=role_subject(self.worker_id),
            transfer_endpoint=self.agent.endpoint,
            kv_base_address=engine.kv_layout.base_address,
            kv_layout=KVLayoutSpec.from_layout(engine.kv_layout),
            host=self.settings.advertise_host,
            pid=os.getpid(),
            started_at=self._started_at,
            health_url=self.health.url,
        )

    async def register(self) -> None:
        """Announce the worker in etcd; call once its work subjects are subscribed."""
        self.registration = LeasedKey(
            self.store,
            self.keys.worker(self.settings.role, self.worker_id),
            self.record().encode(),
            ttl=self.settings.lease_ttl,
            # a claimed identity had no record: one there now is the holder's that took it since
            replace=not self.settings.identity_slots,
        )
        await self.registration.start()
        logger.info("%s worker %s ready", self.settings.role, self.worker_id)

    async def subscribe_work(self, subject: str, handler: Callable[[Msg], Awaitable[None]], queue: str = "") -> None:
        self._work_subscriptions.append(await self.nc.subscribe(subject, queue=queue, cb=handler))

    # -- health ----------------------------------------------------------------------------
    def engine_stepping(self) -> bool:
        engine = getattr(self, "engine", None)
        return (
            engine is not None
            and engine.is_alive()
            and engine.heartbeat_age() < self.settings.engine_stall_limit
        )

    def health_status(self) -> HealthStatus:
        """Live while the engine thread is (or the model is still loading); ready when the
        engine steps, NATS and etcd are connected, the worker is registered and not draining."""
        engine = getattr(self, "engine", None)
        loading = engine is None
        nc = getattr(self, "nc", None)
        checks = {
            "engine": self.engine_stepping(),
            "nats": nc is not None and nc.is_connected,
            "etcd": self.registration is not None and self.registration.confirmed,
            "accepting": not self.draining,
        }
        live = loading or (engine is not None and engine.is_alive())
        detail = "loading the model" if loading else ", ".join(f"{k} failing" for k, ok in checks.items() if not ok)
        return HealthStatus(live=live and self.exit_code == 0, ready=all(checks.values()), checks=checks, detail=detail)

    async def _watch_engine(self) -> None:
        error = await self.engine.wait_dead()
        if self._stopped.is_set():
            return  # shut down on purpose
        logger.critical("the engine stopped (%r); exiting so that a supervisor restarts this worker", error)
        self.exit_code = 1
        self._stopped.set()

    def heartbeat(self, subject: str | None, request_id: str, stage: Stage) -> Heartbeat:
        """Progress messages to ``subject`` while the ``async with`` block runs."""
        return Heartbeat(
            self.nc,
            subject,
            request_id,
            self.worker_id,
            interval=self.settings.mesh.heartbeat_interval,
            stage=stage,
            engine_stepping=self.engine_stepping,
        )

    def spawn(self, coroutine: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """Run a request's work in the background, tracked so drain can wait for it."""
        task = asyncio.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("task %s failed", task.get_name(), exc_info=task.exception())

    # -- control messages ----------------------------------------------------------------
    async def _handle_cancel(self, msg: Msg) -> None:
        try:
            request_id = CancelRequest.decode(msg.data).request_id
        except ValueError:
            return
        await self.on_cancel(request_id)

    async def _abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def stats(self) -> WorkerStats:
        pool = await self.engine.pool_stats()
        return WorkerStats(
            worker_id=self.worker_id,
            num_blocks=pool.num_blocks,
            num_free=pool.num_free,
            num_cached=pool.num_cached,
            num_in_use=pool.num_in_use,
            num_held=pool.num_held,
            pins=self.pin_count(),
            bytes_pulled=self.agent.bytes_read,
            bytes_served=self.bytes_served,
            transfers=self.agent.transfers,
        )

    def transferred(self, direction: str, nbytes: int, seconds: float) -> None:
        """A KV pull into this worker (``in``) or out of it (``out``), for its metrics."""
        if self.metrics is not None:
            self.metrics.transferred(direction, nbytes, seconds)

    async def _handle_stats(self, msg: Msg) -> None:
        await msg.respond((await self.stats()).encode())

    def load_report(self) -> LoadReport:
        load = self.engine.load_now()  # never queued behind a long engine step
        return LoadReport(
            worker_id=self.worker_id,
            role=self.settings.role,
            running=load["running"],
            waiting=load["waiting"] + self.queued_outside_engine(),
            free_blocks=load["free_blocks"],
            total_blocks=self.engine.kv_layout.num_blocks,
            draining=self.draining,
            ready=self.health_status().ready,
            timestamp=time.time(),
        )

    async def _report_load(self) -> None:
        while True:
            try:
                await self.nc.publish(self.subjects.load_from(self.worker_id), self.load_report().encode())
            except Exception as exc:  # noqa: BLE001 - a missed report is not fatal
                logger.debug("load report failed: %s", exc)
            await pause(self.settings.load_interval)

    # -- stop ----------------------------------------------------------------------------
    async def drain(self) -> None:
        """Stop taking work, finish what is in flight, leave etcd."""
        if self.draining:
            return
        self.draining = True
        logger.info("draining: %d requests in flight", len(self._tasks))
        for subscription in self._work_subscriptions:
            await subscription.unsubscribe()
        if self._tasks:
            done, pending = await asyncio.wait(set(self._tasks), timeout=self.settings.drain_timeout)
            for task in pending:
                task.cancel()
        try:  # the last token events reach NATS before the record leaves etcd
            await asyncio.wait_for(self.nc.flush(), 2)
        except Exception as exc:  # noqa: BLE001 - leaving anyway
            logger.debug("flush before leaving failed: %s", exc)
        if self.registration is not None:
            await self.registration.stop(revoke=True)

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Run ``closer`` at close, before the engine and the connections go."""
        self._closers.append(closer)

    async def close(self) -> None:
        for closer in reversed(self._closers):  # last registered, first closed
            try:
                await closer()
            except Exception:  # noqa: BLE001 - keep closing the rest
                logger.exception("closing step failed")
        for task in self._background:
            task.cancel()
        if self.directory is not None:
            await self.directory.stop()
        if self.registration is not None:
            await self.registration.stop(revoke=False)
        try:
            await asyncio.wait_for(self.nc.drain(), 5)
        except Exception:  # noqa: BLE001 - closing anyway
            await self.nc.close()
        await self.store.close()
        await self.engine.shutdown()
        await self.health.stop()
        shutdown_tracing()

    async def serve_until_signalled(self) -> int:
        """Block until SIGTERM or SIGINT (or the engine's death), then drain and close.
        Returns the process's exit code."""
        await until_signalled(self._stopped)
        if self.exit_code == 0:
            logger.info("signal received")
            await self.drain()
        elif self.registration is not None:
            await self.registration.stop(revoke=True)  # leave the directory at once
        await self.close()
        logger.info("stopped")
        return self.exit_code
