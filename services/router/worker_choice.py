"""Choosing a worker: the least loaded live one, by its latest load report and the requests
this router has sent it since; the decode worker holding most of a prompt's prefix
(``kv_aware_decode``), and whether it prefills the prompt itself (``local_prefill_reason``);
and which prefill workers a decode worker can pull from at all (``layout_mismatch``)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field

from kvmesh.protocol import KVLayoutSpec, LoadReport, WorkerRecord

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Choice:
    worker: WorkerRecord
    reason: str
    cached_blocks: int = 0  # leading prompt blocks it holds (the KV index's answer)


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


def compare_layouts(prefill: KVLayoutSpec, decode: KVLayoutSpec) -> str | None:
    """How two published pool layouts differ where a pull needs them alike (``None``: they do not)."""
    return prefill.to_layout().mismatch(decode.to_layout())


def layout_mismatch(
    prefill: WorkerRecord, decode: WorkerRecord, compare: Callable[[KVLayoutSpec, KVLayoutSpec], str | None] = compare_layouts
) -> str | None:
    """Why ``decode`` cannot pull the KV blocks of ``prefill`` (``None``: it can): their
    published pool layouts must agree on block size, dtype, layers, heads, head dim and K/V
    arrangement (strides and engines may differ)."""
    if prefill.kv_layout is None or decode.kv_layout is None:
        missing = prefill if prefill.kv_layout is None else decode
        return f"{missing.worker_id} has published no KV layout"
    mismatch = compare(prefill.kv_layout, decode.kv_layout)
    if mismatch is None:
        return None
    return f"{prefill.worker_id}'s KV layout does not match {decode.worker_id}'s ({mismatch})"


# Layout comparisons ``LayoutPairing`` keeps (pairs of published layouts), at most.
MAX_COMPARED_LAYOUTS = 1024


@dataclass(slots=True)
class LayoutPairing:
    """Which prefill workers a decode worker can pull from. Each skipped pair (of two
    incarnations) is logged once; the reasons also go with every request's route. The
    comparison of two published layouts (immutable) is made once per pair of them, not on
    every request: building the pool layouts took a good part of a route's time."""

    _logged: set[tuple[str, float, str, float]] = field(default_factory=set)
    _compared: dict[tuple[int, int], tuple[KVLayoutSpec, KVLayoutSpec, str | None]] = field(default_factory=dict)

    def compare(self, prefill: KVLayoutSpec, decode: KVLayoutSpec) -> str | None:
        """``compare_layouts``, remembered by the two layout objects (kept, so their ids stay theirs)."""
        key = (id(prefill), id(decode))
        known = self._compared.get(key)
        if known is None:
            if len(self._compared) >= MAX_COMPARED_LAYOUTS:
                self._compared.clear()
            known = self._compared[key] = (prefill, decode, compare_layouts(prefill, decode))
        return known[2]

    def pairable(
        self, prefills: Iterable[WorkerRecord], decode: WorkerRecord
    ) -> tuple[list[WorkerRecord], dict[str, str]]:
        """The prefill workers ``decode`` can pull from, and why each other one is skipped."""
        kept: list[WorkerRecord] = []
        skipped: dict[str, str] = {}
        for prefill in prefills:
            reason = layout_mismatch(prefill, decode, self.compare)
            if reason is None:
                kept.append(prefill)
                continue
            skipped[prefill.worker_id] = reason
            pair = (prefill.worker_id, prefill.started_at, decode.worker_id, decode.started_at)
            if pair not in self._logged:
                self._logged.add(pair)
                logger.warning("not pairing prefill worker %s with decode worker %s: %s", prefill.worker_id, decode.worker_id, reason)
        return kept, skipped


# The longest rest of a prompt a decode worker holding more of its prefix than any prefill
# worker prefills itself (``local_prefill_reason``; 0: never). A chat's follow-up turn adds
# the previous answer's last partial block, the template and a new message: tens of tokens,
# well under this. On CPU 256 tokens are under a second of one core's prefill (~470 prompt
# tokens/s on two: docs/benchmarks.md), about the longest the decode worker's other streams
# should stall for work a prefill worker could take; a longer rest goes to a prefill worker,
# which recomputes what the decode worker held more of but leaves its decoding alone.
LOCAL_PREFILL_MAX_TOKENS = 256

# A decode worker holding more of a prompt's prefix is preferred while it is at most this
# many requests busier than the least loaded one (or, when that one already runs many, half
# as many again): affinity must not pile every conversation onto one worker.
DECODE_LOAD_SLACK = 2
DECODE_LOAD_RATIO = 0.5


def kv_aware_decode(
    candidates: list[WorkerRecord], board: LoadBoard, exclude: Container[str], matches: Mapping[str, int]
) -> Choice | None:
    """The usable decode worker holding the longest cached prefix of the prompt
    (``matches``: leading blocks per worker, from the KV index) among those not much busier
    than the least loaded (``DECODE_LOAD_SLACK``, ``DECODE_LOAD_RATIO``); the least loaded
    of the holders, at random among equals. No hit: ``least_loaded``."""
    usable = [w for w in candidates if w.worker_id not in exclude and board.usable(w.worker_id)]
    if not usable:
        return None
    lowest = min(board.load(w.worker_id) for w in usable)
    bound = lowest + max(DECODE_LOAD_SLACK, lowest * DECODE_LOAD_RATIO)
    within = [w for w in usable if board.load(w.worker_id) <= bound]
    most = max(matches.get(w.worker_id, 0) for w in within)
    if most <= 0:
        return least_loaded(usable, board, ())
    holders = [w for w in within if matches.get(w.worker_id, 0) == most]
    load = min(board.load(w.worker_id) for w in holders)
    worker = random.choice([w for w in holders if board.load(w.worker_id) == load])
    reason = f"holds {most} prefix blocks, {load:g} queued (least loaded {lowest:g}) of {len(usable)}"
    return Choice(worker, reason, most)


def local_prefill_reason(
    prompt_tokens: int, block_size: int, decode_blocks: int, prefill_blocks: int, max_tokens: int
) -> str | None:
    """Why the chosen decode worker should prefill the prompt itself rather than have a
    prefill worker do it and move the KV over (conditional disaggregation, as Dynamo's
    disaggregated router and vLLM's P/D proxies do), or None: it holds more of the prompt's
    prefix (``decode_blocks``) than the best prefill worker (``prefill_blocks``, which would
    recompute the difference; on a tie the prefill worker keeps the work, and the decode
    worker's core its decoding), and what it lacks is at most ``max_tokens`` tokens (0:
    never)."""
    if max_tokens <= 0 or decode_blocks <= prefill_blocks:
        return None
    remainder = prompt_tokens - decode_blocks * block_size
    if remainder > max_tokens:
        return None
    return (
        f"the decode worker holds {decode_blocks} prefix blocks (the best prefill worker {prefill_blocks}); "
        f"{remainder} tokens to prefill (at most {max_tokens})"
    )


# Where the router learns which workers hold a prompt's prefix: its own copy of the KV index
# (``kvmesh.kvindex.replica``), or kv-metadata asked once a request.
KV_INDEXES = ("replica", "kv-metadata")

ROUTE_REASONS = ("prefix_cache", "peer_prefix", "load", "local_prefill", "decode_prefix")


def route_reason(prefill: Choice | None, peer: object | None, *, decode_prefix: bool = False) -> str:
    """Why an attempt went where it did, in ``ROUTE_REASONS``: the decode worker prefills
    because it holds more of the prompt's prefix and the rest is short (``decode_prefix``),
    or because no prefill worker is usable (``local_prefill``); a prefill worker holding part
    of the prompt's prefix, one that will pull it from a peer, or one chosen on load alone."""
    if decode_prefix:
        return "decode_prefix"
    if prefill is None:
        return "local_prefill"
    if peer is not None:
        return "peer_prefix"
    return "prefix_cache" if prefill.cached_blocks else "load"
