"""The router's way into the mesh: prefill on one worker, decode on another, tokens back.

For each request: pick a prefill worker (if any is alive) and a decode worker, ask the
prefill worker for the first token and a KV handle, hand the handle to the decode worker
and yield the numbered token events in order. Each work request is published with a
reply subject of this router's (``stream.<router>.<random key>.<phase>``), and the worker
answers there, progress and tokens alike: NATS lets a worker publish to a reply subject only
as a response to a message it received, so a worker can speak only into the streams it was
handed. A failure anywhere (a worker killed or silent, a pull that fails) is retried on
other workers, resuming from the tokens already sent; the waiting itself is
``attempts``. Leaving the stream early cancels the request on the workers.

Which workers hold a prompt's prefix comes from the router's own copy of the KV index
(``kv_index="replica"``, the default: ``kvmesh.kvindex.replica``, kept from the same event
batches and snapshots as kv-metadata's, so routing costs no round trip), or from kv-metadata,
asked once per request (``kv_index="kv-metadata"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats
import nats.errors
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry import trace
from pydantic import ValidationError

from kvmesh.cluster.connect import connect_mesh
from kvmesh.cluster.directory import WorkerDirectory
from kvmesh.cluster.etcd_store import EtcdStore
from kvmesh.engine.loader.default_model import resolve_model, served_model_name
from kvmesh.engine.model.config import ModelConfig
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import ErrorCode, MeshError, is_retryable
from kvmesh.protocol import (
    CancelRequest,
    DecodeRequest,
    Keys,
    KVQuery,
    KVQueryReply,
    KVSnapshot,
    LoadReport,
    PeerPrefix,
    PrefillRequest,
    PrefillResponse,
    SamplingSpec,
    StreamPhase,
    Subjects,
    TokenEvent,
    WorkerRecord,
)
from kvmesh.hashing import hash_to_hex, hash_token_blocks
from kvmesh.kvindex.replica import IndexReplica, pool_capacity
from kvmesh.routing.plugins import Candidate, RouteRequest
from kvmesh.routing.scorer import load_scorer_config
from kvmesh.services.router.attempts import (
    DRAINED_GRACE,
    OVERLOADED_BACKOFF,
    Attempt,
    NoResponders,
    Retry,
    WorkerGone,
    events_in_order,
    next_item,
)
from kvmesh.services.router.backend import HealthReport
from kvmesh.services.router.progress import RequestProgress
from kvmesh.services.router.streams import Streams, new_key
from kvmesh.services.router.worker_choice import (
    KV_INDEXES,
    LOCAL_PREFILL_MAX_TOKENS,
    Choice,
    Excluded,
    LayoutPairing,
    LoadBoard,
    kv_aware_decode,
    least_loaded,
    local_prefill_reason,
    route_reason,
)
from kvmesh.telemetry import inject_headers, tracer
from kvmesh.settings.mesh import MeshSettings

logger = logging.getLogger(__name__)

Matches = Callable[[int], Awaitable[dict[str, int]]]  # which workers hold the prompt's prefix, by block size


@dataclass(slots=True)
class Route:
    """Where one attempt goes: its decode worker, and the prefill worker (with a peer to
    lend it a prefix) or none, the decode worker then prefilling the prompt itself."""

    decode: Choice
    prefill: Choice | None
    peer: PeerPrefix | None
    reason: str  # one of ``ROUTE_REASONS``


class MeshBackend:
    def __init__(
        self,
        mesh: MeshSettings,
        *,
        model: str | None = None,
        served_name: str | None = None,
        max_attempts: int = 3,
        router_id: str | None = None,
        routing_config: str | dict | None = None,
        kv_query_timeout: float = 0.05,
        worker_wait: float = 10.0,
        local_prefill_max_tokens: int = LOCAL_PREFILL_MAX_TOKENS,
        kv_index: str = "replica",
    ) -> None:
        if kv_index not in KV_INDEXES:
            raise ValueError(f"kv_index must be one of {', '.join(KV_INDEXES)}, not {kv_index!r}")
        self.mesh = mesh
        self.subjects = Subjects(mesh.namespace)
        self.keys = Keys(mesh.namespace)
        self.router_id = router_id or uuid.uuid4().hex[:12]
        self.max_attempts = max_attempts
        self.model_dir = model_dir = resolve_model(model)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.model_name = served_name or served_model_name(model, model_dir)
        model_config = ModelConfig.from_dir(model_dir)
        self._model_max_len = model_config.max_position_embeddings
        # The same stop tokens the engine uses: the tokenizer's and the model config's.
        self.eos_token_ids = tuple(dict.fromkeys((*self.tokenizer.eos_token_ids, *model_config.eos_token_ids)))
        self.board = LoadBoard()
        self.scorer = load_scorer_config(routing_config)  # how prefill workers are chosen
        self.pairing = LayoutPairing()  # prefill workers only for decode workers that can pull their KV
        self.kv_query_timeout = kv_query_timeout
        # this router's copy of the KV index (None: kv-metadata is asked per request)
        self.replica = (
            IndexReplica(self.subjects, self._fetch_snapshot, capacity=lambda w: pool_capacity(self.directory.workers.get(w)))
            if kv_index == "replica"
            else None
        )
        self.worker_wait = worker_wait  # seconds a request waits for a decode worker to come back
        # the longest rest of a prompt a decode worker holding more of its prefix prefills itself (0: never)
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self._attempts: dict[str, Attempt] = {}  # by attempt id
        self.streams = Streams()  # the same, by the random key of their stream subjects
        self._tracer = tracer("kvmesh.router")
        # The router's metrics hear of each routing decision and retry (``RouterMetrics.watch``).
        self.on_route: Callable[[str], None] = lambda reason: None
        self.on_retry: Callable[[str], None] = lambda kind: None
        self.nc: nats.NATS
        self.store: EtcdStore
        self.directory: WorkerDirectory

    async def start(self) -> None:
        self.nc, self.store = await connect_mesh(self.mesh, f"router-{self.router_id}")
        self.directory = WorkerDirectory(self.store, self.keys, max_model_len=self._model_max_len)
        self.directory.on_change(self._worker_changed)
        if self.replica is not None:  # before the directory: a joining worker's snapshot, then its batches
            await self.nc.subscribe(self.subjects.kv_events, cb=self._handle_kv_events)
        await self.directory.start()
        from kvmesh.security.senders import from_own_subject  # a load report only on its worker's own subject

        await self.nc.subscribe(self.subjects.load, cb=from_own_subject(self._handle_load, LoadReport))
        await self.nc.subscribe(self.subjects.streams_of(self.router_id), cb=self.streams.handle)

    async def close(self) -> None:
        await self.directory.stop()
        if self.replica is not None:
            await self.replica.close()
        await self.nc.drain()
        await self.store.close()

    # -- what the HTTP layer reads ---------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        lengths = [w.max_model_len for w in self.directory.workers.values() if w.role == "decode"]
        return min(lengths) if lengths else self._model_max_len

    def ready_workers(self, role: str) -> list[WorkerRecord]:
        """Registered, and their latest load report is fresh and says ready."""
        return [w for w in self.directory.alive(role) if self.board.ready(w.worker_id)]

    async def health(self) -> HealthReport:
        """Ready when a decode worker is ready by its own checks (engine stepping, NATS and
        etcd connected): it can also prefill, so that is a live prefill path too."""
        ready = {role: len(self.ready_workers(role)) for role in ("prefill", "decode")}
        registered = {role: len(self.directory.alive(role)) for role in ("prefill", "decode")}
        if not self.nc.is_connected:
            return HealthReport(False, ready, "the router is not connected to NATS")
        if ready["decode"] < 1:
            counts = ", ".join(f"{role}={n}" for role, n in sorted(registered.items()))
            return HealthReport(False, ready, f"no decode worker is ready (registered: {counts})")
        return HealthReport(True, ready)

    # -- NATS callbacks ------------------------------------------------------------------
    async def _handle_load(self, msg: Msg) -> None:
        try:
            self.board.update(LoadReport.decode(msg.data))
        except ValidationError:
            logger.debug("malformed load report")

    async def _handle_kv_events(self, msg: Msg) -> None:
        if self.replica is not None:
            self.replica.receive(msg.subject, msg.data)

    async def _fetch_snapshot(self, worker_id: str) -> KVSnapshot:
        reply = await self.nc.request(self.subjects.kv_snapshot(worker_id), b"", timeout=self.mesh.request_timeout)
        return KVSnapshot.decode(reply.data)

    def _worker_changed(self, worker_id: str, record: WorkerRecord | None) -> None:
        if self.replica is not None:
            if record is None:
                self.replica.left(worker_id)
            elif record.role in ("prefill", "decode"):
                self.replica.joined(worker_id)
        if record is not None:
            return
        report = self.board.reports.get(worker_id)
        self.board.forget(worker_id)
        gone = WorkerGone(worker_id)
        for attempt in self._attempts.values():
            if not attempt.waits_on(worker_id):
                continue
            if report is not None and report.draining:
                # It finished its work before leaving: its last events may still be on the
                # way (NATS and etcd are separate paths). Give them a moment.
                asyncio.get_running_loop().call_later(DRAINED_GRACE, attempt.events.put_nowait, gone)
            else:
                attempt.events.put_nowait(gone)

    # -- one request ---------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        session_id: str | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """The request's events for the client. The first token is sent as soon as the
        prefill worker returns it; a failure anywhere is retried on other workers, resuming
        from the tokens already sent (prompt + those tokens prefilled again, mostly from the
        prefix cache), so a client sees one uninterrupted stream."""
        # The span is passed explicitly, never made current: this generator yields to the
        # HTTP layer between tokens, and a context attached across a yield is not safe.
        span = self._tracer.start_span("mesh_request")
        span.set_attribute("kvmesh.request_id", request_id)
        span.set_attribute("kvmesh.prompt_tokens", len(prompt_token_ids))
        ctx = trace.set_span_in_context(span)
        progress = RequestProgress(request_id, self.tokenizer, sampling, self.eos_token_ids, len(prompt_token_ids))
        excluded = Excluded(self.directory.workers)
        last_reason = "no attempt made"
        deadline = asyncio.get_running_loop().time() + self.mesh.request_deadline
        failures = 0  # attempts that failed on a worker; "too busy, try later" does not count
        attempt_number = -1
        try:
            while failures < self.max_attempts:
                attempt_number += 1
                attempt_id = f"{request_id}-{attempt_number}"
                span.set_attribute("kvmesh.attempts", attempt_number + 1)
                attempt_sampling = progress.attempt_sampling()
                attempt = self._attempt(
                    attempt_id,
                    prompt_token_ids + progress.emitted,
                    attempt_sampling,
                    excluded,
                    span,
                    ctx,
                    deadline,
                    session_id,
                    resumed=attempt_number > 0,  # it already waited once: ahead of new work
                )
                try:
                    async with contextlib.aclosing(attempt) as events:  # closing cancels the attempt at once
                        async for tokens in events:
                            if attempt_number == 0 and tokens.num_cached_tokens:
                                progress.num_cached_tokens = tokens.num_cached_tokens
                            if tokens.prompt_logprobs is not None and progress.prompt_logprobs is None:
                                progress.prompt_logprobs = tokens.prompt_logprobs
                            event = progress.add(
                                tokens.token_ids, tokens.finish_reason if tokens.finished else None, tokens.logprobs
                            )
                            if event is not None:
                                yield event
                            if progress.finished:
                                return
                    raise Retry("the stream ended without a last event", None, kind="stream_ended")
                except Retry as retry:
                    last_reason = str(retry)
                    self.on_retry(retry.kind)
                    span.add_event("retry", {"reason": last_reason, "tokens_sent": len(progress.emitted)})
                    if retry.exclude:
                        failures += 1
                        if retry.bad_worker:
                            excluded.add(retry.bad_worker, retry.incarnation)
                    else:  # bounded by the request's deadline
                        await asyncio.sleep(OVERLOADED_BACKOFF)
                    logger.warning(
                        "request %s attempt %d failed after %d tokens (%s); retrying",
                        request_id,
                        attempt_number,
                        len(progress.emitted),
                        retry,
                    )
            raise MeshError(ErrorCode.UNAVAILABLE, f"the request failed after {self.max_attempts} attempts: {last_reason}")
        except MeshError as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
            raise
        finally:
            span.end()

    async def _attempt(
        self,
        attempt_id: str,
        prompt: list[int],
        sampling: SamplingSpec,
        excluded: Excluded,
        span: trace.Span,
        ctx,
        deadline: float,
        session_id: str | None = None,
        resumed: bool = False,
    ) -> AsyncGenerator[TokenEvent, None]:
        """One try: the first token from a prefill worker, the rest from a decode worker
        (or all of it from a decode worker that prefills the prompt itself). Yields events
        whose token ids are new (their text is ignored: the router detokenizes)."""
        route = await self._route(attempt_id, prompt, sampling, excluded, session_id, span, deadline)
        decode, prefill, peer = route.decode, route.prefill, route.peer
        self.on_route(route.reason)
        span.set_attribute("kvmesh.decode_worker", decode.worker.worker_id)
        span.set_attribute("kvmesh.decode_choice", decode.reason)
        span.set_attribute("kvmesh.prefill_worker", prefill.worker.worker_id if prefill else "")
        span.set_attribute("kvmesh.route.reason", route.reason)
        attempt = Attempt(
            attempt_id,
            decode.worker.worker_id,
            prefill.worker.worker_id if prefill else None,
            deadline,
            key=new_key(),
        )
        attempt.incarnations[decode.worker.worker_id] = decode.worker.started_at
        if prefill is not None:
            attempt.incarnations[prefill.worker.worker_id] = prefill.worker.started_at
        self._attempts[attempt_id] = attempt
        self.streams.open(attempt)
        self.board.add(decode.worker.worker_id, 1)
        finished = False
        try:
            first_sent = False
            prefilled: dict[str, Any] = {}  # what the decode request carries of the prefill's answer
            if prefill is not None:
                response = await self._prefill(attempt, prefill.worker, prompt, sampling, ctx, peer, resumed=resumed)
                first_sent = True
                assert response.first_token_id is not None  # _prefill checked it
                yield TokenEvent(
                    request_id=attempt_id,
                    seq=-1,
                    token_ids=[response.first_token_id],
                    num_cached_tokens=response.num_cached_tokens,
                    logprobs=[response.first_logprob] if sampling.logprobs is not None else None,
                    prompt_logprobs=response.prompt_logprobs,
                )
                prefilled = {"first_token_id": response.first_token_id, "kv": response.kv, "prefill_cached_tokens": response.num_cached_tokens}
            # made after the first token went to the client: off that token's path
            request = DecodeRequest(request_id=attempt_id, prompt_token_ids=prompt, sampling=sampling, resumed=resumed, **prefilled)
            attempt.stage = "decode"
            attempt.heard()
            await self._start_decode(decode.worker, attempt, request, ctx)
            async for event in events_in_order(attempt, self.mesh):
                finished = event.finished
                if first_sent and event.token_ids:  # the decode side starts with the prefill's token
                    logprobs = event.logprobs[1:] if event.logprobs is not None else None
                    event = event.model_copy(update={"token_ids": event.token_ids[1:], "logprobs": logprobs})
                    first_sent = False
                yield event
        finally:
            self.board.add(decode.worker.worker_id, -1)
            self._attempts.pop(attempt_id, None)
            self.streams.close(attempt)
            if not finished:
                await self._cancel(attempt_id)

    async def _route(
        self,
        attempt_id: str,
        prompt: list[int],
        sampling: SamplingSpec,
        excluded: Excluded,
        session_id: str | None,
        span: trace.Span,
        deadline: float,
    ) -> Route:
        """The decode worker holding most of the prompt's prefix (by load among equals), a
        prefill worker for it by the routing config's scores, and then, where that decode
        worker holds more of the prefix than any prefill worker and what it lacks is short
        (``local_prefill_max_tokens``), no prefill worker: it prefills the rest itself
        instead of importing KV it mostly has (a chat's next turn, whose previous answer
        it generated and cached). One look-up in the KV index serves all three choices."""
        answers: dict[int, dict[str, int]] = {}

        async def matches(block_size: int) -> dict[str, int]:
            if block_size not in answers:
                answers[block_size] = await self._prefix_matches(prompt, block_size, span)
            return answers[block_size]

        decode = await self._decode_worker(excluded, deadline, matches)
        routed = await self._choose_prefill(attempt_id, prompt, excluded, session_id, span, decode.worker, matches)
        if routed is None:
            return Route(decode, None, None, route_reason(None, None))
        prefill, peer, best_prefill_blocks = routed
        if sampling.prompt_logprobs is not None:
            # it computes every prompt position anyway (``kvmesh.engine.logprobs``): no cache helps
            return Route(decode, prefill, None, route_reason(prefill, None))
        block_size = decode.worker.kv_layout.block_size if decode.worker.kv_layout else 16
        why = local_prefill_reason(len(prompt), block_size, decode.cached_blocks, best_prefill_blocks, self.local_prefill_max_tokens)
        if why is None:
            return Route(decode, prefill, peer, route_reason(prefill, peer))
        span.set_attribute("kvmesh.route.local_prefill", why)
        return Route(Choice(decode.worker, f"{decode.reason}; {why}", decode.cached_blocks), None, None, route_reason(None, None, decode_prefix=True))

    async def _decode_worker(self, excluded: Excluded, deadline: float, matches: Matches) -> Choice:
        """The usable decode worker holding most of the prompt's prefix, not much busier
        than the least loaded one (``kv_aware_decode``) where that can matter
        (``_kv_aware_decode_pays``), else the least loaded; while there is none (one
        restarting, say), wait up to ``worker_wait`` seconds for one to join before
        answering unavailable."""
        loop = asyncio.get_running_loop()
        give_up = min(deadline, loop.time() + self.worker_wait)
        while True:
            choice = least_loaded(self.directory.alive("decode"), self.board, excluded)
            if choice is not None and self._kv_aware_decode_pays(excluded):
                candidates = self.directory.alive("decode")
                layout = choice.worker.kv_layout
                found = await matches(layout.block_size if layout else 16)
                choice = kv_aware_decode(candidates, self.board, excluded, found) or choice
            if choice is not None:
                return choice
            if excluded.second_chance(self.directory.alive("decode")):
                continue
            left = give_up - loop.time()
            if left <= 0:
                raise MeshError(ErrorCode.UNAVAILABLE, "no decode worker is available")
            try:  # a worker joining, or a fresh load report making one usable
                await self.directory.wait_for(
                    lambda d: least_loaded(d.alive("decode"), self.board, excluded) is not None, min(left, 0.25)
                )
            except TimeoutError:
                pass

    def _kv_aware_decode_pays(self, excluded: Excluded) -> bool:
        """Whether the decode worker's cached prefix can matter: with no usable prefill
        worker every decode worker prefills itself, so its cache counts where there is a
        choice; with one, only where a holder may prefill in its stead (conditional
        disaggregation on). Otherwise the choice is by load, and the KV index is not read."""
        def usable(role: str) -> list[WorkerRecord]:
            return [w for w in self.directory.alive(role) if w.worker_id not in excluded and self.board.usable(w.worker_id)]

        if not usable("prefill"):
            return len(usable("decode")) > 1
        return self.local_prefill_max_tokens > 0

    async def _choose_prefill(
        self,
        attempt_id: str,
        prompt: list[int],
        excluded: Excluded,
        session_id: str | None,
        span: trace.Span,
        decode: WorkerRecord,
        matches_of: Matches,
    ) -> tuple[Choice, PeerPrefix | None, int] | None:
        """The prefill worker with the best weighted score (prefix cached there, load,
        session affinity, ...), as the routing config says, among those whose KV layout
        ``decode`` can pull (None: the decode worker prefills itself), a peer to lend it a
        prefix, and the most leading prompt blocks any of them holds. The decision and
        every score go on the request's span."""
        pairable, skipped = self.pairing.pairable(self.directory.alive("prefill"), decode)
        if skipped:
            span.set_attribute("kvmesh.route.skipped_prefill", [f"{w}: {why}" for w, why in skipped.items()])
        records = {w.worker_id: w for w in pairable if w.worker_id not in excluded and self.board.usable(w.worker_id)}
        if not records:
            return None
        layout = next(iter(records.values())).kv_layout
        block_size = layout.block_size if layout else 16
        matches = await matches_of(block_size)
        candidates = [self._candidate(record, matches.get(worker_id, 0)) for worker_id, record in records.items()]
        route = RouteRequest(attempt_id, num_blocks=len(prompt) // block_size, num_tokens=len(prompt), session_id=session_id)
        decision = self.scorer.choose(route, candidates)
        self.scorer.observe(route, decision.worker_id)
        # The routing span: the decision and every plugin's score of every candidate.
        route_span = self._tracer.start_span("route", context=trace.set_span_in_context(span))
        for key, value in decision.span_attributes().items():
            route_span.set_attribute(key, value)
        cached = matches.get(decision.worker_id, 0)
        route_span.set_attribute("kvmesh.route.cached_prefix_blocks", cached)
        route_span.set_attribute("kvmesh.route.kv_metadata_answered", bool(matches))
        # A peer holding more of the prefix than the chosen worker can lend it (the chosen
        # worker pulls it when that is cheaper than recomputing).
        peer = None
        best_peer = max((w for w in records if w != decision.worker_id), key=lambda w: matches.get(w, 0), default=None)
        if best_peer is not None and matches.get(best_peer, 0) > cached:
            peer = PeerPrefix(worker_id=best_peer, num_blocks=matches[best_peer])
            route_span.set_attribute("kvmesh.route.peer", best_peer)
            route_span.set_attribute("kvmesh.route.peer_prefix_blocks", peer.num_blocks)
        best = max(matches.get(w, 0) for w in records)
        if decode.worker_id in matches:
            route_span.set_attribute("kvmesh.route.decode_prefix_blocks", matches[decode.worker_id])
        route_span.end()
        return Choice(records[decision.worker_id], f"score {decision.total:.1f}, {cached} prefix blocks cached", cached), peer, best

    def _candidate(self, record: WorkerRecord, cached_prefix_blocks: int) -> Candidate:
        report = self.board.reports.get(record.worker_id)
        total = record.kv_layout.num_blocks if record.kv_layout else 0
        return Candidate(
            worker_id=record.worker_id,
            running=(report.running if report else 0) + self.board.in_flight.get(record.worker_id, 0),
            waiting=report.waiting if report else 0,
            free_blocks=report.free_blocks if report else total,
            total_blocks=report.total_blocks if report else total,
            cached_prefix_blocks=cached_prefix_blocks,
        )

    async def _prefix_matches(self, prompt: list[int], block_size: int, span: trace.Span | None = None) -> dict[str, int]:
        """How many leading blocks of the prompt's block chain each worker holds: from this
        router's replica of the index, or kv-metadata's answer (empty when it is not running
        or does not answer in time: routing then goes on load alone)."""
        if span is not None:
            span.set_attribute("kvmesh.route.kv_index", "replica" if self.replica is not None else "kv-metadata")
        if self.replica is not None:
            return self.replica.index.prefix_match(hash_token_blocks(prompt, block_size, (self.model_name,)))
        if not self.directory.alive("kv-metadata"):
            return {}
        chain = [hash_to_hex(h) for h in hash_token_blocks(prompt, block_size, (self.model_name,))]
        if not chain:
            return {}
        try:
            headers = inject_headers(trace.set_span_in_context(span)) if span is not None else None  # kv-metadata's span joins the request's
            reply = await self.nc.request(
                self.subjects.kv_query, KVQuery(block_hashes=chain).encode(), timeout=self.kv_query_timeout, headers=headers
            )
            return KVQueryReply.decode(reply.data).matches
        except (TimeoutError, NatsTimeoutError, NoRespondersError, ValidationError) as exc:
            logger.debug("kv-metadata did not answer: %r", exc)
            return {}

    async def _prefill(
        self,
        attempt: Attempt,
        worker: WorkerRecord,
        prompt: list[int],
        sampling: SamplingSpec,
        ctx,
        peer: PeerPrefix | None = None,
        *,
        resumed: bool = False,
    ) -> PrefillResponse:
        """Ask ``worker`` for the first token and a KV handle. A long prefill is waited for
        as long as the worker says it is working on it (``Progress``); a worker that goes
        silent or leaves the directory is given up on at once."""
        self.board.add(worker.worker_id, 1)
        try:
            with self._tracer.start_as_current_span("prefill_call", context=ctx) as span:
                span.set_attribute("kvmesh.worker_id", worker.worker_id)
                payload = PrefillRequest(
                    request_id=attempt.attempt_id,
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    peer=peer,
                    resumed=resumed,
                ).encode()
                self._check_size(payload, "the prefill request")
                attempt.heard()
                try:
                    await self.nc.publish(
                        worker.subject, payload, reply=self._stream(attempt, "prefill"), headers=inject_headers()
                    )
                except nats.errors.Error as exc:
                    raise Retry(f"prefill on {worker.worker_id}: {type(exc).__name__}", worker.worker_id, incarnation=worker.started_at, kind="publish_failed") from None
                while True:
                    item = await next_item(attempt, self.mesh, worker.worker_id)
                    if isinstance(item, NoResponders) and item.phase == "prefill":
                        raise Retry(f"prefill on {worker.worker_id}: no responders", worker.worker_id, incarnation=worker.started_at, kind="no_responders")
                    if isinstance(item, PrefillResponse):
                        response = item
                        break
        finally:
            self.board.add(worker.worker_id, -1)
        if response.error is not None:
            if is_retryable(response.error.code):
                busy = response.error.code is ErrorCode.OVERLOADED
                raise Retry(f"prefill on {worker.worker_id}: {response.error.message}", worker.worker_id, exclude=not busy, incarnation=worker.started_at, kind="overloaded" if busy else "worker_error")
            raise MeshError(response.error.code, response.error.message)
        if response.first_token_id is None or response.kv is None:
            raise Retry(f"prefill on {worker.worker_id} answered without a first token and KV", worker.worker_id, incarnation=worker.started_at, kind="no_first_token")
        return response

    async def _start_decode(self, worker: WorkerRecord, attempt: Attempt, request: DecodeRequest, ctx) -> None:
        """Send the work; its ack and events come on the attempt's decode stream
        (``events_in_order``), a worker that never answers is given up on by silence."""
        payload = request.encode()
        self._check_size(payload, "the decode request")
        try:
            await self.nc.publish(worker.subject, payload, reply=self._stream(attempt, "decode"), headers=inject_headers(ctx))
        except nats.errors.Error as exc:
            raise Retry(f"decode on {worker.worker_id}: {type(exc).__name__}", worker.worker_id, incarnation=worker.started_at, kind="publish_failed") from None

    def _stream(self, attempt: Attempt, phase: StreamPhase) -> str:
        return self.subjects.stream(self.router_id, attempt.key, phase)

    def _check_size(self, payload: bytes, what: str) -> None:
        """A message NATS would refuse is refused here, before it is sent."""
        limit = self.nc.max_payload
        if limit and len(payload) > limit:
            raise MeshError(
                ErrorCode.TOO_LARGE, f"{what} is {len(payload)} bytes; the mesh carries at most {limit} bytes a message"
            )

    async def _cancel(self, attempt_id: str) -> None:
        try:
            await self.nc.publish(self.subjects.cancel, CancelRequest(request_id=attempt_id).encode())
        except Exception as exc:  # noqa: BLE001 - best effort; leases and timeouts clean up
            logger.debug("cancel of %s not sent: %s", attempt_id, exc)

