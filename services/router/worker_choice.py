"""Choosing a worker: the least loaded live one, by its latest load report and the requests
this router has sent it since (KV-aware scoring plugins come with the cluster KV cache); and
which prefill workers a decode worker can pull from at all (``layout_mismatch``)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field

from kvmesh.protocol import LoadReport, WorkerRecord

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Choice:
    worker: WorkerRecord
    reason: str
    cached_blocks: int = 0  # a prefill worker's: leading prompt blocks it holds


class LoadBoard:
    """Latest load report per worker, plus requests in flight from this router."""

    def __init__(self, *, stale_after: float = 3.0) -> None:
        self.reports: dict[str, LoadReport] = {}
        self.received_at: dict[str, float] = {}
        self.in_flight: dict[str, int] = {}
        self.stale_after = stale_after

    def update(self, report: LoadReport) -> None:
        self.reports[report.worker_id] = report
        self.received_at[report.worker_id] = time.monotonic()

    def forget(self, worker_id: str) -> None:
        self.reports.pop(worker_id, None)
        self.received_at.pop(worker_id, None)
        self.in_flight.pop(worker_id, None)

    def add(self, worker_id: str, delta: int) -> None:
        self.in_flight[worker_id] = max(0, self.in_flight.get(worker_id, 0) + delta)

    def usable(self, worker_id: str) -> bool:
        """Not draining, not saying it is unready, and not silent for longer than
        ``stale_after`` (a hung or dead worker whose lease has not run out yet). A worker
        not yet heard from is usable."""
        report = self.reports.get(worker_id)
        if report is None:
            return True
        return self.ready(worker_id)

    def ready(self, worker_id: str) -> bool:
        """Heard from lately, and its own checks say it can take work."""
        report = self.reports.get(worker_id)
        if report is None:
            return False
        fresh = time.monotonic() - self.received_at[worker_id] < self.stale_after
        return fresh and report.ready and not report.draining

    def load(self, worker_id: str) -> float:
        report = self.reports.get(worker_id)
        queued = report.running + report.waiting if report else 0
        return queued + self.in_flight.get(worker_id, 0)


class Excluded:
    """The workers one request gave up on, by incarnation: a worker restarted under the same
    id (a new ``started_at``) is a new worker, and may be tried again."""

    def __init__(self, workers: Mapping[str, WorkerRecord]) -> None:
        self._workers = workers  # the live directory
        self._given_up: dict[str, float | None] = {}
        self._second_chance_used = False

    def second_chance(self, candidates: list[WorkerRecord]) -> bool:
        """Once per request, when every live candidate was given up on: try them again.
        A worker that fell silent may only have lost its NATS connection (its rights to
        answer earlier work go with it) and serves new work once reconnected; one that is
        really gone leaves the directory, and the request's attempts stay bounded."""
        if self._second_chance_used:
            return False
        forgiven = [w.worker_id for w in candidates if w.worker_id in self]
        for worker_id in forgiven:
            del self._given_up[worker_id]
        self._second_chance_used = bool(forgiven)
        return bool(forgiven)

    def add(self, worker_id: str, started_at: float | None = None) -> None:
        """Give up on the incarnation that started at ``started_at`` (default: the one in
        the directory now)."""
        if started_at is None:
            record = self._workers.get(worker_id)
            started_at = record.started_at if record is not None else None
        self._given_up[worker_id] = started_at

    def __contains__(self, worker_id: object) -> bool:
        if not isinstance(worker_id, str) or worker_id not in self._given_up:
            return False
        record = self._workers.get(worker_id)
        return record is None or record.started_at == self._given_up[worker_id]


def least_loaded(candidates: list[WorkerRecord], board: LoadBoard, exclude: Container[str]) -> Choice | None:
    usable = [w for w in candidates if w.worker_id not in exclude and board.usable(w.worker_id)]
    if not usable:
        return None
    lowest = min(board.load(w.worker_id) for w in usable)
    best = [w for w in usable if board.load(w.worker_id) == lowest]
    worker = random.choice(best)
    return Choice(worker, f"least loaded ({lowest:g} queued) of {len(usable)}")


def layout_mismatch(prefill: WorkerRecord, decode: WorkerRecord) -> str | None:
    """Why ``decode`` cannot pull the KV blocks of ``prefill`` (``None``: it can): their
    published pool layouts must agree on block size, dtype, layers, heads, head dim and K/V
    arrangement (strides and engines may differ)."""
    if prefill.kv_layout is None or decode.kv_layout is None:
        missing = prefill if prefill.kv_layout is None else decode
        return f"{missing.worker_id} has published no KV layout"
    mismatch = prefill.kv_layout.to_layout().mismatch(decode.kv_layout.to_layout())
    if mismatch is None:
        return None
    return f"{prefill.worker_id}'s KV layout does not match {decode.worker_id}'s ({mismatch})"


@dataclass(slots=True)
class LayoutPairing:
    """Which prefill workers a decode worker can pull from. Each skipped pair (of two
    incarnations) is logged once; the reasons also go with every request's route."""

    _logged: set[tuple[str, float, str, float]] = field(default_factory=set)

    def pairable(
        self, prefills: Iterable[WorkerRecord], decode: WorkerRecord
    ) -> tuple[list[WorkerRecord], dict[str, str]]:
        """The prefill workers ``decode`` can pull from, and why each other one is skipped."""
        kept: list[WorkerRecord] = []
        skipped: dict[str, str] = {}
        for prefill in prefills:
            reason = layout_mismatch(prefill, decode)
            if reason is None:
                kept.append(prefill)
                continue
            skipped[prefill.worker_id] = reason
            pair = (prefill.worker_id, prefill.started_at, decode.worker_id, decode.started_at)
            if pair not in self._logged:
                self._logged.add(pair)
                logger.warning("not pairing prefill worker %s with decode worker %s: %s", prefill.worker_id, decode.worker_id, reason)
        return kept, skipped


ROUTE_REASONS = ("prefix_cache", "peer_prefix", "load", "local_prefill")


def route_reason(prefill: Choice | None, peer: object | None) -> str:
    """Why an attempt went where it did, in ``ROUTE_REASONS``: no prefill worker (the decode
    worker prefills), a prefill worker holding part of the prompt's prefix, one that will
    pull it from a peer, or one chosen on load alone."""
    if prefill is None:
        return "local_prefill"
    if peer is not None:
        return "peer_prefix"
    return "prefix_cache" if prefill.cached_blocks else "load"
