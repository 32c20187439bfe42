"""Continuous batching with chunked prefill under a token budget, preemption by recompute.

Each step the running requests are served first (one token each while decoding, the next
chunk while prefilling), then waiting requests are admitted while the token budget, the
sequence limit and the KV pool allow. When a running request needs a block and none is
free, the most recently admitted running request is preempted: its blocks are freed (full
ones stay in the prefix cache) and it waits to be recomputed. Admission keeps back the blocks
the running requests are expected to grow into (``kvmesh.engine.admission``), so that a
waiting request is not let in only to be preempted again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.engine.admission import Growth, GrowthReserve
from kvmesh.engine.kv_cache_manager import KVCacheManager, cdiv
from kvmesh.engine.request import FinishReason, Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """This step reaches the request's last known token, so it yields a new token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)


@dataclass(slots=True, frozen=True)
class PendingImport:
    """Blocks taken for a request's imported KV before it runs: it will have ``num_tokens``
    (its prompt and the first token, made where the prompt was) and may make
    ``max_tokens_left`` more."""

    num_tokens: int
    max_tokens_left: int
    num_blocks: int


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    reserve_growth: bool = True  # admission keeps blocks back for the running requests' growth


class Scheduler:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig) -> None:
        self.kv = kv
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.reserve = GrowthReserve(config.max_model_len, kv.block_size)
        self.reserved_blocks = 0  # what admission last kept back for growth while requests waited
        self.importing: dict[str, PendingImport] = {}  # handle -> an import's blocks, taken, not yet a request's

    def check_new_id(self, request_id: str) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if request_id in self.kv.held:
            raise ValueError(f"request id {request_id!r} still has exported KV blocks held")

    def add_request(self, req: Request, *, first: bool = False) -> None:
        """Queue a request; with ``first`` ahead of those waiting (a retry), and exempt from
        the growth reserve where its client is mid-answer (``Request.mid_answer``)."""
        self.check_new_id(req.request_id)
        if req.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {req.num_tokens} tokens; this engine serves at most "
                f"{self.config.max_model_len - 1} prompt tokens"
            )
        self.requests[req.request_id] = req
        if first:
            req.resumed = True
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """Admit a request whose KV is already in its blocks (a disaggregated decode)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        req.status = RequestStatus.RUNNING
        req.first_scheduled_time = time.monotonic()
        self.running.append(req)

    def take_import(self, handle: str, num_tokens: int, max_tokens: int | None, *, resumed: bool = False) -> list[int] | None:
        """Blocks, held under ``handle``, for the KV of ``num_tokens`` prompt tokens pulled
        from a peer; ``None`` if no room. With ``max_tokens`` (a request to decode here,
        its first token made where its prompt was) only where admission takes it now: with
        a seat in the batch (``max_num_seqs``, imports on their way counted), after the
        waiting requests and, as theirs, beside the growth of those running
        (``kvmesh.engine.admission``); ``resumed`` (a stream mid-answer) or without
        ``max_tokens`` (a borrowed prefix), wherever the blocks fit. The growth of a
        request's import counts for the others' admission until it runs."""
        if max_tokens is None:
            return self.kv.allocate_held(handle, num_tokens)
        if not resumed:
            self._forget_arrived_imports()
            if len(self.running) + len(self.importing) >= self.config.max_num_seqs:
                return None  # every seat of the batch taken or promised: ``max_num_seqs`` holds for imports too
            if self.config.reserve_growth and not self._admits_import(num_tokens, max_tokens):
                return None
        block_ids = self.kv.allocate_held(handle, num_tokens)
        if block_ids is not None:
            self.importing[handle] = PendingImport(num_tokens + 1, max_tokens - 1, len(block_ids))
        return block_ids

    def _admits_import(self, num_tokens: int, max_tokens: int) -> bool:
        if self.waiting:
            return False
        self._forget_arrived_imports()
        ratio = self.reserve.ratio
        growths = self._growths(ratio)
        if not growths:
            return True  # nothing running: admitted whatever it may need
        new = self.reserve.expected(self.reserve.allowance_of(num_tokens + 1, max_tokens - 1), num_tokens + 1, 0, ratio)
        return self.reserve.peak_blocks([*growths, new]) <= self.kv.pool.num_free_blocks

    def _forget_arrived_imports(self) -> None:
        """Imports whose blocks became a request's, or were given back, are on their way no more."""
        for handle in [h for h in self.importing if h not in self.kv.held]:
            del self.importing[handle]

    def _growths(self, ratio: float) -> list[Growth]:
        """The expected growth of the running requests and of the imports on their way."""
        growths = [self.reserve.growth(r, len(self.kv.req_blocks.get(r.request_id, ())), ratio) for r in self.running]
        for pending in self.importing.values():
            allowance = self.reserve.allowance_of(pending.num_tokens, pending.max_tokens_left)
            growths.append(self.reserve.expected(allowance, pending.num_tokens, pending.num_blocks, ratio))
        return growths

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
                index += 1
                continue
            break
        self.reserve.stepped()
        self.reserved_blocks = 0
        self._forget_arrived_imports()
        if out.preempted:
            self.reserve.preempted()
            return out
        growths: list[Growth] | None = None  # the running requests' and imports' expected growth
        ratio = self.reserve.ratio
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hits = self.kv.get_computed_blocks(req)
            num_hit_tokens = len(hits) * self.kv.block_size
            num_new = min(req.num_tokens - num_hit_tokens, budget)
            if self.config.reserve_growth:
                if growths is None:
                    growths = self._growths(ratio)
                if growths and not req.mid_answer and not self._fits_beside(req, hits, growths, ratio):
                    self.reserved_blocks = self.reserve.peak_blocks(growths)
                    break
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break
            if growths is not None:
                growths.append(self.reserve.growth(req, len(self.kv.req_blocks.get(req.request_id, ())), ratio))
            self.waiting.popleft()
            req.num_computed_tokens = num_hit_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return out

    def _fits_beside(self, req: Request, hits: Sequence, growths: list[Growth], ratio: float) -> bool:
        """Whether the free blocks hold what ``req`` and the running requests (``growths``)
        are expected to need at once, at every step ahead (its cached hits on the free list
        stop being free)."""
        evictable_hits = sum(1 for block in hits if block.ref_cnt == 0)
        peak = self.reserve.peak_blocks([*growths, self.reserve.growth(req, len(hits), ratio)])
        return peak <= self.kv.pool.num_free_blocks - evictable_hits

    def _preempt(self, req: Request) -> None:
        logger.debug("preempting %s at %d tokens", req.request_id, req.num_tokens)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput, sampled: Sequence[int]) -> list[Request]:
        """Advance the scheduled requests; append sampled tokens (one per sampling request,
        in order). Returns the requests that got a new token."""
        advanced: list[Request] = []
        tokens = iter(sampled)
        for item in out.scheduled:
            req = item.request
            samples = item.samples
            req.num_computed_tokens += item.num_new_tokens
            if not samples:
                continue
            token = next(tokens)
            req.token_ids.append(token)
            advanced.append(req)
            reason = self.token_stop_reason(req, token)
            if reason is not None:
                self.finish(req, reason)
        return advanced

    def token_stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.sampling
        if req.export_kv:
            return FinishReason.LENGTH  # the first token is all a prefill-for-export makes
        if not params.ignore_eos and token in req.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    # -- leaving -------------------------------------------------------------------------
    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request (finished or aborted) and give its blocks back, or hold them for
        export when it is a prefill whose KV another worker will pull."""
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self.reserve.finished(req)
        if req.export_kv and reason not in (FinishReason.ABORT, FinishReason.ERROR):
            self.kv.hold(req)
        else:
            self.kv.free(req)

    def fail(self, req: Request, *, kv_written: bool = True) -> None:
        """End a request the engine could not serve (``FinishReason.ERROR``): its blocks are
        freed, an export is not held. ``kv_written=False`` means its scheduled step never
        ran: the blocks that step named in the prefix cache hold no KV, so they lose their
        names first. A request already finished (its output failed) gives back its export."""
        if req.is_finished:
            if req.export_kv:
                self.kv.release_held(req.request_id)
            req.finish_reason = FinishReason.ERROR
            return
        if not kv_written:
            first = req.num_computed_tokens // self.kv.block_size
            self.kv.pool.uncache(self.kv.req_blocks.get(req.request_id, [])[first:])
        self.finish(req, FinishReason.ERROR)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
        return req


def max_model_len(max_positions: int, num_blocks: int, block_size: int) -> int:
    """Longest sequence the engine accepts: the model's positions and the whole pool."""
    return min(max_positions, num_blocks * block_size)


__all__ = [
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "cdiv",
    "max_model_len",
]
