"""Routing score plugins: each rates every candidate worker for one request in [0, 100].

In the manner of Kthena's router (``pkg/kthena-router/scheduler/plugins``): a plugin has a
``name`` and one method, ``score(request, candidates) -> list[float]``, one score per
candidate in the candidates' order; a ``WeightedScorer`` (``kvmesh.routing.scorer``) adds the
scores up with weights from a config file. A plugin that learns from decisions (session
affinity) also has ``observe(request, worker_id)``.

The plugins are pure: they read what the router knows about each candidate (load reports,
the KV index's prefix answers) and return numbers. They import no transport.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

MAX_SCORE = 100.0


@dataclass(slots=True, frozen=True)
class Candidate:
    """What the router knows about one worker when it routes a request.

    ``cached_prefix_blocks``: how many of the request's leading blocks the worker holds
    (the KV index's answer). ``queue_seconds``: estimated time until the worker could start
    this request (its backlog over its prefill rate). ``peer_prefix_blocks``: the longest
    leading run of the request's blocks the worker could pull from a peer instead of
    recomputing it (0: none known).
    """

    worker_id: str
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    cached_prefix_blocks: int
    queue_seconds: float = 0.0
    peer_prefix_blocks: int = 0


@dataclass(slots=True, frozen=True)
class RouteRequest:
    """The request being routed. ``num_blocks``: its prompt's blocks (full blocks for the
    router, which hashes only full ones); ``num_tokens``: its prompt tokens."""

    request_id: str
    num_blocks: int
    num_tokens: int
    session_id: str | None = None


@runtime_checkable
class ScorePlugin(Protocol):
    name: str

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        """One score in [0, 100] per candidate, in order; higher is better."""
        ...


@dataclass(slots=True, frozen=True)
class PrefillPlan:
    """How a prompt would be prefilled on one worker: blocks pulled from a peer, tokens
    computed, and the seconds that takes (pulls plus compute, queueing excluded)."""

    pulled_blocks: int
    computed_tokens: int
    seconds: float


def plan_prefill(
    num_tokens: int,
    local_blocks: int,
    reachable_blocks: int,
    prefill_rate: float,
    pull_seconds: float,
    block_size: int,
) -> PrefillPlan:
    """Reuse ``local_blocks`` leading blocks, pull blocks ``local_blocks .. reachable_blocks-1``
    from a peer while a pull is cheaper than recomputing that block (a short last block may
    not be), compute the rest at ``prefill_rate`` tokens/s."""
    pulled = 0
    for index in range(local_blocks, reachable_blocks):
        block_tokens = min(block_size, num_tokens - index * block_size)
        if block_tokens <= 0 or pull_seconds >= block_tokens / prefill_rate:
            break
        pulled += 1
    cached_tokens = min((local_blocks + pulled) * block_size, num_tokens)
    computed = num_tokens - cached_tokens
    return PrefillPlan(pulled, computed, computed / prefill_rate + pulled * pull_seconds)


class PrefixOverlapPlugin:
    """The share of the request's blocks the candidate already holds, times 100."""

    name = "prefix"

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        if request.num_blocks <= 0:
            return [0.0] * len(candidates)
        return [
            MAX_SCORE * min(max(c.cached_prefix_blocks, 0), request.num_blocks) / request.num_blocks
            for c in candidates
        ]


class LoadPlugin:
    """Less queued work and more free KV blocks score higher.

    Queued work is ``running + waiting`` requests, normalized by the busiest candidate:
    ``100 * (max_q - q) / max_q`` (100 for all when none has any). Free blocks score
    ``100 * free / total``. The plugin's score is their mean.
    """

    name = "load"

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        queued = [max(c.running, 0) + max(c.waiting, 0) for c in candidates]
        busiest = max(queued, default=0)
        scores = []
        for c, q in zip(candidates, queued):
            queue_score = MAX_SCORE if busiest == 0 else MAX_SCORE * (busiest - q) / busiest
            free_score = 0.0 if c.total_blocks <= 0 else MAX_SCORE * min(max(c.free_blocks, 0), c.total_blocks) / c.total_blocks
            scores.append((queue_score + free_score) / 2)
        return scores


class SessionAffinityPlugin:
    """100 for the worker that last served the request's ``x-session-id``, else 0.

    Remembers at most ``max_sessions`` sessions, forgetting the least recently seen.
    """

    name = "session"

    def __init__(self, max_sessions: int = 10_000) -> None:
        if not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be a positive integer, got {max_sessions!r}")
        self.max_sessions = max_sessions
        self._last: OrderedDict[str, str] = OrderedDict()

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        worker = self._last.get(request.session_id) if request.session_id is not None else None
        return [MAX_SCORE if worker is not None and c.worker_id == worker else 0.0 for c in candidates]

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        if request.session_id is None:
            return
        self._last[request.session_id] = worker_id
        self._last.move_to_end(request.session_id)
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)

    def __len__(self) -> int:
        return len(self._last)


class RandomPlugin:
    """A uniform random score per candidate, from its own seeded generator."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        return [self._rng.uniform(0.0, MAX_SCORE) for _ in candidates]


class EstimatedTtftPlugin:
    """Cache- and load-aware, like Mooncake's Conductor: estimate each candidate's time to
    first token, ``queue_seconds`` + pulls from a peer + uncached tokens over the prefill
    rate (``plan_prefill``), and score ``100 * best / estimate`` (the fastest gets 100)."""

    name = "ttft"

    def __init__(self, prefill_rate: float, pull_seconds: float, block_size: int = 512) -> None:
        if not _finite(prefill_rate) or prefill_rate <= 0:
            raise ValueError(f"prefill_rate must be a positive number, got {prefill_rate!r}")
        if not _finite(pull_seconds) or pull_seconds < 0:
            raise ValueError(f"pull_seconds must be a number >= 0, got {pull_seconds!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.prefill_rate = float(prefill_rate)
        self.pull_seconds = float(pull_seconds)
        self.block_size = block_size

    def estimate(self, request: RouteRequest, candidate: Candidate) -> float:
        local = min(max(candidate.cached_prefix_blocks, 0), request.num_blocks)
        reachable = max(local, min(candidate.peer_prefix_blocks, request.num_blocks))
        plan = plan_prefill(request.num_tokens, local, reachable, self.prefill_rate, self.pull_seconds, self.block_size)
        return max(candidate.queue_seconds, 0.0) + plan.seconds

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        estimates = [self.estimate(request, c) for c in candidates]
        best = min(estimates, default=0.0)
        return [MAX_SCORE if e <= best else MAX_SCORE * best / e for e in estimates]


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


PLUGIN_TYPES: dict[str, type] = {
    PrefixOverlapPlugin.name: PrefixOverlapPlugin,
    LoadPlugin.name: LoadPlugin,
    SessionAffinityPlugin.name: SessionAffinityPlugin,
    RandomPlugin.name: RandomPlugin,
    EstimatedTtftPlugin.name: EstimatedTtftPlugin,
}
