"""A model-free simulation of prefill workers under a routing policy, driven by a trace.

Each of ``workers`` simulated prefill workers has an LRU cache of ``cache_blocks`` block
hashes and a FIFO queue served at ``prefill_rate`` tokens/s; pulling one block from a peer
costs ``pull_seconds``. Requests arrive at their timestamps and are routed on arrival. A
request's time to first token is its queue wait + its pulls * ``pull_seconds`` + its
uncached tokens / ``prefill_rate`` (its leading cached blocks, up to its input length, are
skipped; the last block may be short).

The cache: after a request is served, all its blocks (hits, pulled, computed) are in its
worker's LRU, touched tail first as vLLM frees a request's blocks, so a prefix outlives its
tail. Each cached block carries the time it became ready there (computed: when the request
finished; pulled: when the pulls finished). A worker serves its queue in order, so its own
blocks are always ready when a later request starts; a peer's block can be pulled only if
it is ready when the puller starts. Peers are read as they stand when the request is routed
(an approximation: a peer evicting a block between routing and the pull is not modelled).

Policies: ``random``, ``round-robin``, ``least-load`` (earliest free), ``prefix-only``
(longest local prefix, ties to earliest free), ``kv-aware`` (Mooncake Conductor-style: the
minimum estimated TTFT, with cross-worker pulls, scored by ``EstimatedTtftPlugin``),
``kv-aware-local`` (the same without pulls) and ``weighted`` (a ``WeightedScorer`` from a
scorer config, Kthena-style; the default config without one). Only the kv-aware policy
pulls from peers. Scored policies list their candidates earliest-free first, so equal
scores go to the worker idle the longest.
"""

from __future__ import annotations

import logging
import math
import random
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvmesh.replay.trace import MOONCAKE_BLOCK_SIZE, TraceRequest
from kvmesh.routing.plugins import Candidate, EstimatedTtftPlugin, RouteRequest, plan_prefill
from kvmesh.routing.scorer import WeightedScorer, load_scorer_config

logger = logging.getLogger(__name__)

DEFAULT_POLICIES = ("random", "round-robin", "least-load", "prefix-only", "kv-aware")
POLICIES = (*DEFAULT_POLICIES, "kv-aware-local", "weighted")
_PULLING = frozenset({"kv-aware"})


@dataclass(slots=True, frozen=True)
class SimConfig:
    workers: int
    cache_blocks: int
    prefill_rate: float  # prompt tokens per second, per worker
    pull_seconds: float  # to pull one block from a peer
    block_size: int = MOONCAKE_BLOCK_SIZE
    seed: int = 0  # for the random policy
    scorer_config: Mapping[str, Any] | None = None  # for the weighted policy

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.cache_blocks < 0:
            raise ValueError(f"cache_blocks must be >= 0, got {self.cache_blocks}")
        if not math.isfinite(self.prefill_rate) or self.prefill_rate <= 0:
            raise ValueError(f"prefill_rate must be > 0, got {self.prefill_rate}")
        if not math.isfinite(self.pull_seconds) or self.pull_seconds < 0:
            raise ValueError(f"pull_seconds must be >= 0, got {self.pull_seconds}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


@dataclass(slots=True)
class PolicyResult:
    """Figures for one policy. ``ttfts`` and ``choices`` (worker index) are per request,
    in arrival order; ``to_dict`` leaves them out."""

    policy: str
    requests: int
    blocks: int
    local_hit_blocks: int
    pulled_blocks: int
    hit_rate: float
    oracle_hit_rate: float
    hit_pct_of_oracle: float
    computed_tokens: int
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    max_utilization: float
    imbalance: float
    ttfts: list[float] = field(repr=False)
    choices: list[int] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        figures = asdict(self)
        del figures["ttfts"], figures["choices"]
        return figures


def oracle_hits(trace: Sequence[TraceRequest]) -> int:
    """Blocks an unbounded cache shared by all workers would hit: those an earlier request had."""
    seen: set[int] = set()
    hits = 0
    for request in trace:
        hits += sum(1 for h in request.hash_ids if h in seen)
        seen.update(request.hash_ids)
    return hits


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of ascending values (0 for none)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


class SimWorker:
    """One simulated prefill worker: its LRU of block hashes, when it is free, its backlog."""

    __slots__ = ("index", "worker_id", "cache", "capacity", "free_at", "busy", "inflight", "held_blocks")

    def __init__(self, index: int, capacity: int) -> None:
        self.index = index
        self.worker_id = f"w{index}"
        self.cache: OrderedDict[int, float] = OrderedDict()  # hash -> ready time, LRU first
        self.capacity = capacity
        self.free_at = 0.0
        self.busy = 0.0
        self.inflight: deque[tuple[float, float, int]] = deque()  # (start, finish, blocks)
        self.held_blocks = 0

    def prefix_ready(self, hash_ids: Sequence[int]) -> list[float]:
        """For each leading block held here, the time by which it and all before it are ready."""
        ready: list[float] = []
        latest = -math.inf
        cache = self.cache
        for h in hash_ids:
            t = cache.get(h)
            if t is None:
                break
            latest = t if t > latest else latest
            ready.append(latest)
        return ready

    def retire(self, now: float) -> None:
        while self.inflight and self.inflight[0][1] <= now:
            self.held_blocks -= self.inflight.popleft()[2]

    def store(self, hash_ids: Sequence[int], local: int, pulled: int, pulled_ready: float, finish: float) -> None:
        cache = self.cache
        for i in range(len(hash_ids) - 1, -1, -1):  # tail first: the head ends most recent
            h = hash_ids[i]
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = pulled_ready if local <= i < local + pulled else finish
        while len(cache) > self.capacity:
            cache.popitem(last=False)


class _Run:
    """One policy over one trace."""

    def __init__(self, trace: Sequence[TraceRequest], config: SimConfig, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        self.trace = trace
        self.config = config
        self.policy = policy
        self.pulls = policy in _PULLING
        self.workers = [SimWorker(i, config.cache_blocks) for i in range(config.workers)]
        self.rng = random.Random(config.seed)
        self.next_rr = 0
        self.scorer: WeightedScorer | None = None
        if policy in ("kv-aware", "kv-aware-local"):
            ttft = EstimatedTtftPlugin(config.prefill_rate, config.pull_seconds, config.block_size)
            self.scorer = WeightedScorer([(ttft, 1.0)])
        elif policy == "weighted":
            self.scorer = load_scorer_config(config.scorer_config)

    def reach(self, prefixes: list[list[float]], worker: int, start: float) -> int:
        """The longest leading run of blocks ``worker`` holds or (pulling) can pull by ``start``."""
        best = len(prefixes[worker])
        if self.pulls:
            for q, ready in enumerate(prefixes):
                if q != worker and len(ready) > best:
                    best = max(best, bisect_right(ready, start))
        return best

    def choose(self, request: TraceRequest, now: float, prefixes: list[list[float]]) -> int:
        workers = self.workers
        if self.policy == "round-robin":
            choice = self.next_rr % len(workers)
            self.next_rr += 1
            return choice
        if self.policy == "random":
            return self.rng.randrange(len(workers))
        if self.policy == "least-load":
            return min(range(len(workers)), key=lambda i: (workers[i].free_at, i))
        if self.policy == "prefix-only":
            return min(range(len(workers)), key=lambda i: (-len(prefixes[i]), workers[i].free_at, i))
        assert self.scorer is not None
        route = RouteRequest(str(request.index), len(request.hash_ids), request.input_length)
        candidates = []
        # Ties go to the first candidate: list the earliest free first (idle longest), as
        # prefix-only breaks its ties, so that equal estimates spread over idle workers.
        for w in sorted(workers, key=lambda w: (w.free_at, w.index)):
            w.retire(now)
            running = 1 if w.inflight and w.inflight[0][0] <= now else 0
            start = max(now, w.free_at)
            candidates.append(
                Candidate(
                    worker_id=w.worker_id,
                    running=running,
                    waiting=len(w.inflight) - running,
                    free_blocks=max(w.capacity - w.held_blocks, 0),
                    total_blocks=w.capacity,
                    cached_prefix_blocks=len(prefixes[w.index]),
                    queue_seconds=start - now,
                    peer_prefix_blocks=self.reach(prefixes, w.index, start),
                )
            )
        decision = self.scorer.choose(route, candidates)
        self.scorer.observe(route, decision.worker_id)
        return int(decision.worker_id[1:])

    def run(self) -> PolicyResult:
        config = self.config
        ttfts: list[float] = []
        choices: list[int] = []
        local_hits = pulled_total = computed_total = blocks_total = 0
        for request in self.trace:
            now = request.arrival
            prefixes = [w.prefix_ready(request.hash_ids) for w in self.workers]
            index = self.choose(request, now, prefixes)
            worker = self.workers[index]
            start = max(now, worker.free_at)
            local = len(prefixes[index])
            plan = plan_prefill(
                request.input_length, local, self.reach(prefixes, index, start),
                config.prefill_rate, config.pull_seconds, config.block_size,
            )
            finish = start + plan.seconds
            worker.store(request.hash_ids, local, plan.pulled_blocks, start + plan.pulled_blocks * config.pull_seconds, finish)
            worker.free_at = finish
            worker.busy += plan.seconds
            worker.retire(now)
            worker.inflight.append((start, finish, len(request.hash_ids)))
            worker.held_blocks += len(request.hash_ids)
            ttfts.append(finish - now)
            choices.append(index)
            local_hits += local
            pulled_total += plan.pulled_blocks
            computed_total += plan.computed_tokens
            blocks_total += len(request.hash_ids)
        return self.result(ttfts, choices, local_hits, pulled_total, computed_total, blocks_total)

    def result(
        self, ttfts: list[float], choices: list[int], local_hits: int, pulled: int, computed: int, blocks: int
    ) -> PolicyResult:
        trace = self.trace
        oracle = oracle_hits(trace) / blocks if blocks else 0.0
        hit_rate = (local_hits + pulled) / blocks if blocks else 0.0
        ordered = sorted(ttfts)
        first = trace[0].arrival if trace else 0.0
        end = max([w.free_at for w in self.workers] + [trace[-1].arrival if trace else 0.0])
        span = end - first
        busy = [w.busy for w in self.workers]
        mean_busy = sum(busy) / len(busy)
        result = PolicyResult(
            policy=self.policy,
            requests=len(trace),
            blocks=blocks,
            local_hit_blocks=local_hits,
            pulled_blocks=pulled,
            hit_rate=hit_rate,
            oracle_hit_rate=oracle,
            hit_pct_of_oracle=100.0 * hit_rate / oracle if oracle else 0.0,
            computed_tokens=computed,
            ttft_mean=sum(ttfts) / len(ttfts) if ttfts else 0.0,
            ttft_p50=percentile(ordered, 50),
            ttft_p90=percentile(ordered, 90),
            ttft_p99=percentile(ordered, 99),
            max_utilization=max(busy) / span if span > 0 else 0.0,
            imbalance=max(busy) / mean_busy if mean_busy > 0 else 1.0,
            ttfts=ttfts,
            choices=choices,
        )
        logger.info(
            "%s: hit rate %.3f (%.1f%% of oracle), TTFT mean %.3f s p90 %.3f s",
            self.policy, hit_rate, result.hit_pct_of_oracle, result.ttft_mean, result.ttft_p90,
        )
        return result


def simulate(trace: Sequence[TraceRequest], config: SimConfig, policy: str) -> PolicyResult:
    """Replay ``trace`` (in arrival order) through fresh workers under ``policy``."""
    return _Run(trace, config, policy).run()


def simulate_policies(trace: Sequence[TraceRequest], config: SimConfig, policies: Sequence[str]) -> list[PolicyResult]:
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {', '.join(unknown)}; known: {', '.join(POLICIES)}")
    return [simulate(trace, config, policy) for policy in policies]
