"""Keep a set of child processes alive: a child that exits is started again after a backoff.

The backoff doubles from ``RestartPolicy.initial`` up to ``maximum`` while a child keeps
dying young, and starts over once it has stayed up ``reset_after`` seconds. Nothing is
restarted after ``close()``. ``check()`` is one pass (notice exits, start those due);
``start()`` runs it on a thread of the supervisor's own, which ends only at ``join()`` —
children it restarted may be tied to it (``PR_SET_PDEATHSIG`` follows the spawning thread),
so join only once they are stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.infra.processes import ManagedProcess, ProcessStartError, describe_exit, stop_all

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class RestartPolicy:
    initial: float = 0.5  # seconds before the first restart
    factor: float = 2.0
    maximum: float = 30.0
    reset_after: float = 30.0  # up this long: the next restart waits ``initial`` again

    def __post_init__(self) -> None:
        if not (0 <= self.initial <= self.maximum and self.factor >= 1 and self.reset_after > 0):
            raise ValueError(f"inconsistent restart policy: {self}")


@dataclass(slots=True)
class Supervised:
    name: str
    process: ManagedProcess | None
    respawn: Callable[[], ManagedProcess]  # starts it again (and tells its owner)
    tier: int = 0  # stop order: lower tiers stop first
    ready: Callable[[str], bool] | None = None  # an output line that says it is serving
    on_exit: Callable[[Supervised], None] | None = None  # clean up after a death, e.g. in etcd
    started_at: float = 0.0  # on the supervisor's clock
    restarts: int = 0  # in all
    delay: float = 0.0  # the wait before the next restart
    restart_at: float | None = None  # a restart is due then
    announced: bool = True  # "ready" was reported for the current process
    lines_seen: int = 0


@dataclass
class Supervisor:
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    report: Callable[[str], None] = logger.info  # one line per exit, restart and recovery
    on_change: Callable[[], None] = lambda: None  # a process was replaced
    clock: Callable[[], float] = time.monotonic
    interval: float = 0.1  # seconds between checks on the thread
    children: dict[str, Supervised] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(
        self,
        name: str,
        process: ManagedProcess,
        respawn: Callable[[], ManagedProcess],
        *,
        tier: int = 0,
        ready: Callable[[str], bool] | None = None,
        on_exit: Callable[[Supervised], None] | None = None,
    ) -> None:
        with self._lock:
            self.children[name] = Supervised(
                name, process, respawn, tier, ready, on_exit, started_at=self.clock(), delay=self.policy.initial
            )

    @property
    def closed(self) -> bool:
        return self._closed

    # -- one pass ------------------------------------------------------------------------
    def check(self) -> None:
        """Notice children that exited and restart those whose backoff is over."""
        with self._lock:
            if self._closed:
                return
            for child in list(self.children.values()):
                self._check_one(child)

    def _check_one(self, child: Supervised) -> None:
        now = self.clock()
        process = child.process
        if process is not None and not process.is_running():
            self._exited(child, process, now)
        elif process is not None and not child.announced and child.ready is not None:
            child.lines_seen, lines = process.lines_since(child.lines_seen)
            if any(child.ready(line) for line in lines):
                child.announced = True
                self.report(f"{child.name} is back (pid {process.pid})")
        if child.restart_at is not None and now >= child.restart_at:
            self._restart(child, now)

    def _exited(self, child: Supervised, process: ManagedProcess, now: float) -> None:
        if now - child.started_at >= self.policy.reset_after:
            child.delay = self.policy.initial
        child.process = None
        child.restarts += 1
        child.restart_at = now + child.delay
        self.report(
            f"{child.name} exited ({describe_exit(process.returncode)}); "
            f"restarting in {child.delay:g} s (restart {child.restarts})"
        )
        process.stop(grace=0)  # reaped: close its log
        if child.on_exit is not None:
            try:
                child.on_exit(child)
            except Exception:  # noqa: BLE001 - cleanup is best effort; the restart goes on
                logger.exception("cleaning up after %s failed", child.name)
        child.delay = min(self.policy.maximum, max(child.delay * self.policy.factor, self.policy.initial))

    def _restart(self, child: Supervised, now: float) -> None:
        child.restart_at = None
        try:
            process = child.respawn()
        except ProcessStartError as exc:
            child.restart_at = now + child.delay
            self.report(f"{child.name} could not be started ({exc}); retrying in {child.delay:g} s")
            child.delay = min(self.policy.maximum, child.delay * self.policy.factor)
            return
        child.process = process
        child.started_at = now  # reset_after counts uptime from here
        child.lines_seen = 0
        child.announced = child.ready is None
        self.report(f"{child.name} restarted (pid {process.pid})")
        self.on_change()

    # -- the thread ----------------------------------------------------------------------
    def start(self) -> None:
        """Check every ``interval`` seconds on a thread of its own until ``join()``."""
        assert self._thread is None, "started twice"
        self._thread = threading.Thread(target=self._run, name="kvmesh-supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._finished.wait(self.interval):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the supervisor must outlive a bad pass
                logger.exception("supervisor check failed")

    def close(self) -> None:
        """No restarts from now on (waits for a pass in progress to finish)."""
        with self._lock:
            self._closed = True

    def join(self) -> None:
        """End the thread; call once the children are stopped."""
        self._finished.set()
        if self._thread is not None:
            self._thread.join(5)

    def stop(self, grace: float = 5.0) -> None:
        """Close, stop every child tier by tier (a tier all at once), end the thread."""
        self.close()
        for tier in sorted({c.tier for c in self.children.values()}):
            stop_all([c.process for c in self.children.values() if c.tier == tier and c.process is not None], grace)
        self.join()

    def pids(self) -> dict[str, int]:
        return {c.name: c.process.pid for c in self.children.values() if c.process is not None}
