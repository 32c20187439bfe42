"""A worker's Prometheus metrics (``kvmesh.metrics.contract.WORKER``), served at ``/metrics``
on its health port.

Tokens and request timings are counted as the engine makes them: this is the engine's
``StepObserver``, told of every step on the engine thread (so a long request's
``generation_tokens`` grow while it runs). As in vLLM, a request's prompt tokens (and its
prefix-cache query and hits) are counted in the step that finishes its prefill, its
generated tokens in the step that samples them. A request decoded from imported KV counts
neither its prompt nor its first token here: the prefill worker that computed them did.
KV usage, blocks and running / waiting are read when scraped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvmesh.engine.core_lending import LendingCounts
from kvmesh.engine.kv_cache_manager import PoolStats
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.request import FinishReason
from kvmesh.metrics import buckets

if TYPE_CHECKING:
    from kvmesh.worker.vllm_stats import RequestPhases

logger = logging.getLogger(__name__)

POOL_STATS_WAIT = 0.5  # seconds a scrape waits for the engine thread's pool stats; then the last ones
LENDING_EVENTS = ("borrowed", "given_back", "wait_given_up")  # LendingCounts' fields, as kvmesh:core_lending's events
TIER = "device"  # the one tier today; the label is there for host and disk tiers


@dataclass(slots=True)
class _Timing:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None


class WorkerMetrics:
    """The worker's registry and the engine's step observer."""

    def __init__(self, model_name: str, role: str, worker_id: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name, "role": role, "worker": worker_id}
        names = list(labels)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, [*names, *extra], registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=r)

        def histogram(name: str, doc: str, bounds: tuple[float, ...], extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, [*names, *extra], buckets=bounds, registry=r)

        self.kv_cache_usage = gauge("kvmesh:kv_cache_usage_perc", "KV cache usage: 1 is full (blocks not free / all blocks)").labels(**labels)
        kv_blocks = gauge("kvmesh:kv_blocks", "KV blocks by state (used, free, cached) and tier", ("state", "tier"))
        self.kv_blocks = {state: kv_blocks.labels(**labels, state=state, tier=TIER) for state in ("used", "free", "cached")}
        self.running = gauge("kvmesh:num_requests_running", "Requests in the engine's running batch").labels(**labels)
        self.waiting = gauge("kvmesh:num_requests_waiting", "Requests waiting to be scheduled").labels(**labels)
        self.reserved = gauge(
            "kvmesh:kv_blocks_reserved_for_growth", "Free KV blocks admission keeps back for running requests' growth"
        ).labels(**labels)
        self.preemptions = counter("kvmesh:num_preemptions", "Requests preempted (recomputed later)").labels(**labels)
        self.prefix_queries = counter(
            "kvmesh:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        ).labels(**labels)
        self.prefix_hits = counter("kvmesh:prefix_cache_hits", "Prompt tokens found in the prefix cache").labels(**labels)
        self.prompt_tokens = counter("kvmesh:prompt_tokens", "Prompt tokens prefilled here").labels(**labels)
        self.generation_tokens = counter("kvmesh:generation_tokens", "Tokens generated here").labels(**labels)
        self.queue_time = histogram(
            "kvmesh:request_queue_time_seconds", "From arrival to first schedule", buckets.REQUEST_LATENCY
        ).labels(**labels)
        self.prefill_time = histogram(
            "kvmesh:request_prefill_time_seconds", "From first schedule to the first token", buckets.REQUEST_LATENCY
        ).labels(**labels)
        self.decode_time = histogram(
            "kvmesh:request_decode_time_seconds", "From the first token to the last", buckets.REQUEST_LATENCY
        ).labels(**labels)
        self.ttft = histogram(
            "kvmesh:time_to_first_token_seconds", "From arrival at the engine to the first token", buckets.TIME_TO_FIRST_TOKEN
        ).labels(**labels)
        self.itl = histogram(
            "kvmesh:inter_token_latency_seconds", "Between two steps' tokens of a request", buckets.INTER_TOKEN_LATENCY
        ).labels(**labels)
        self.e2e = histogram(
            "kvmesh:e2e_request_latency_seconds", "From arrival at the engine to the last token", buckets.REQUEST_LATENCY
        ).labels(**labels)
        transfer_bytes = counter("kvmesh:kv_transfer_bytes", "KV bytes moved between workers", ("direction",))
        transfer_seconds = histogram("kvmesh:kv_transfer_seconds", "One KV pull", buckets.KV_TRANSFER, ("direction",))
        self.transfer_bytes = {d: transfer_bytes.labels(**labels, direction=d) for d in ("in", "out")}
        self.transfer_seconds = {d: transfer_seconds.labels(**labels, direction=d) for d in ("in", "out")}
        self.step_time = histogram("kvmesh:engine_step_seconds", "One engine step", buckets.ENGINE_STEP).labels(**labels)
        snapshots = counter("kvmesh:kv_snapshots", "Answers to requests for this worker's KV snapshot", ("answered",))
        self.snapshots = {a: snapshots.labels(**labels, answered=a) for a in ("engine", "kept")}
        lending = counter("kvmesh:core_lending", "What lending cores between workers did (--lend-cores)", ("event",))
        self.lending = {e: lending.labels(**labels, event=e) for e in LENDING_EVENTS}
        self._lending_seen = LendingCounts()
        self._requests: dict[str, _Timing] = {}
        self._lock = threading.Lock()
        self._preemptions_seen = 0
        self._pool: PoolStats | None = None
        self._engine_phases = False  # queue / prefill / decode times come from the engine (vLLM's)

    # -- StepObserver --------------------------------------------------------------------
    def arrived(self, request_id: str) -> None:
        with self._lock:
            self._requests[request_id] = _Timing(time.monotonic())

    def imported(self, output: RequestOutput) -> None:
        now = time.monotonic()
        with self._lock:
            timing = self._requests.get(output.request_id)
        if timing is None:
            return
        timing.first_token = timing.last_token = now
        self.ttft.observe(now - timing.arrival)
        if output.finished:
            self._finished(output, timing, now)

    def stepped(self, outputs: list[RequestOutput], seconds: float, preemptions: int) -> None:
        now = time.monotonic()
        self.step_time.observe(seconds)
        if preemptions > self._preemptions_seen:
            self.preemptions.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
        for out in outputs:
            with self._lock:
                timing = self._requests.get(out.request_id)
            if timing is None:
                continue
            new = len(out.new_token_ids)
            if new:
                self.generation_tokens.inc(new)
                if timing.first_token is None:
                    self._prefilled(out, timing, now)
                elif timing.last_token is not None:
                    self.itl.observe(now - timing.last_token)
                timing.last_token = now
            if out.finished:
                self._finished(out, timing, now)

    def closed(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    # -- an engine that times request phases itself (``kvmesh.worker.vllm_stats``) -------
    def phases_from_engine(self) -> None:
        self._engine_phases = True

    def engine_phases(self, phases: RequestPhases) -> None:
        """A request the engine finished: its queue, prefill and decode times as it timed them."""
        self.queue_time.observe(phases.queue_seconds)
        self.prefill_time.observe(phases.prefill_seconds)
        self.decode_time.observe(phases.decode_seconds)

    def _prefilled(self, out: RequestOutput, timing: _Timing, now: float) -> None:
        timing.first_token = now
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.prefix_queries.inc(out.num_prompt_tokens)
        self.prefix_hits.inc(min(out.num_cached_tokens, out.num_prompt_tokens))
        ttft = now - timing.arrival
        self.ttft.observe(ttft)
        if self._engine_phases:
            return
        if out.queue_seconds is not None:  # kvmesh's engine says; one that does not: prefill includes the wait
            self.queue_time.observe(out.queue_seconds)
        self.prefill_time.observe(max(0.0, ttft - (out.queue_seconds or 0.0)))

    def _finished(self, out: RequestOutput, timing: _Timing, now: float) -> None:
        with self._lock:
            self._requests.pop(out.request_id, None)
        if out.finish_reason is FinishReason.ERROR:
            return
        self.e2e.observe(now - timing.arrival)
        if timing.first_token is not None and not self._engine_phases:
            self.decode_time.observe(now - timing.first_token)

    # -- transfers -----------------------------------------------------------------------
    def transferred(self, direction: str, nbytes: int, seconds: float) -> None:
        """A KV pull: ``in`` on the worker that read, ``out`` on the one read from (as the
        reader reported it in its release)."""
        if nbytes <= 0:
            return
        self.transfer_bytes[direction].inc(nbytes)
        self.transfer_seconds[direction].observe(max(0.0, seconds))

    def snapshot_answered(self, taken: bool) -> None:
        """A KV snapshot sent: ``taken`` from the engine now, or the last one again."""
        self.snapshots["engine" if taken else "kept"].inc()

    # -- scrape --------------------------------------------------------------------------
    async def render(self, engine, queued: Callable[[], int] = lambda: 0) -> bytes:
        """The registry's text, with the pool and queue gauges read now (pool stats wait at
        most ``POOL_STATS_WAIT`` for the engine thread, else the last ones are shown);
        ``queued``: requests waiting before the engine, counted as waiting."""
        load = engine.load_now()
        try:
            self._pool = await asyncio.wait_for(engine.pool_stats(), POOL_STATS_WAIT)
        except Exception as exc:  # noqa: BLE001 - a busy or dead engine: the last stats, or none
            logger.debug("pool stats for /metrics: %r", exc)
        # the blocks a request may have: vLLM's pool says one fewer than its tensors hold (its null block)
        total = self._pool.num_blocks if self._pool is not None else engine.kv_layout.num_blocks
        self.running.set(load["running"])
        self.waiting.set(load["waiting"] + queued())
        self.reserved.set(load.get("reserved_blocks", 0))  # kvmesh's engine's; vLLM's admission keeps nothing back
        free = load["free_blocks"]  # unreferenced: empty or cached (evictable)
        self.kv_cache_usage.set((total - free) / total if total else 0.0)
        cached = 0
        if self._pool is not None:
            pool = self._pool
            # vLLM's pool does not say which of its cached blocks are unreferenced: at most all of them.
            cached = pool.num_cached_free if pool.num_cached_free is not None else min(pool.num_cached, pool.num_free)
            cached = min(cached, free)
        # The states partition the pool: used + cached + free = every block.
        self.kv_blocks["used"].set(total - free)
        self.kv_blocks["cached"].set(cached)
        self.kv_blocks["free"].set(free - cached)
        self._count_lending(engine.lending_counts())
        return generate_latest(self.registry)

    def _count_lending(self, counts: LendingCounts | None) -> None:
        if counts is None:
            return
        for event in LENDING_EVENTS:
            new = getattr(counts, event) - getattr(self._lending_seen, event)
            if new > 0:
                self.lending[event].inc(new)
        self._lending_seen = counts
