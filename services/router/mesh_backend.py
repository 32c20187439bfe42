"""The router's way into the mesh: prefill on one worker, decode on another, tokens back.

For each request: pick a prefill worker (if any is alive) and a decode worker, ask the
prefill worker for the first token and a KV handle, hand the handle to the decode worker
with a reply subject this router listens on, then yield the numbered token events in
order. While no token has reached the client, a failure anywhere (a worker killed, a pull
that fails, a timeout) is retried on other workers; after that it ends the stream with an
error. Leaving the stream early cancels the request on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats
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
from kvmesh.errors import MeshError
from kvmesh.protocol import (
    CancelRequest,
    DecodeAck,
    DecodeRequest,
    Keys,
    KVQuery,
    KVQueryReply,
    LoadReport,
    PeerPrefix,
    PrefillRequest,
    PrefillResponse,
    SamplingSpec,
    Subjects,
    TokenEvent,
    WorkerRecord,
)
from kvmesh.hashing import hash_to_hex, hash_token_blocks
from kvmesh.routing.plugins import Candidate, RouteRequest
from kvmesh.routing.scorer import load_scorer_config
from kvmesh.services.router.progress import RequestProgress
from kvmesh.services.router.worker_choice import Choice, LoadBoard, least_loaded
from kvmesh.telemetry import inject_headers, tracer
from kvmesh.worker.settings import MeshSettings

logger = logging.getLogger(__name__)

RETRYABLE = {"unavailable", "overloaded", "internal"}
_WORKER_GONE = object()


@dataclass(slots=True)
class _Attempt:
    attempt_id: str
    decode_worker: str
    prefill_worker: str | None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)


class _Retry(Exception):
    def __init__(self, reason: str, bad_worker: str | None) -> None:
        super().__init__(reason)
        self.bad_worker = bad_worker


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
    ) -> None:
        self.mesh = mesh
        self.subjects = Subjects(mesh.namespace)
        self.keys = Keys(mesh.namespace)
        self.router_id = router_id or uuid.uuid4().hex[:12]
        self.max_attempts = max_attempts
        model_dir = resolve_model(model)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.model_name = served_name or served_model_name(model, model_dir)
        model_config = ModelConfig.from_dir(model_dir)
        self._model_max_len = model_config.max_position_embeddings
        # The same stop tokens the engine uses: the tokenizer's and the model config's.
        self.eos_token_ids = tuple(dict.fromkeys((*self.tokenizer.eos_token_ids, *model_config.eos_token_ids)))
        self.board = LoadBoard()
        self.scorer = load_scorer_config(routing_config)  # how prefill workers are chosen
        self.kv_query_timeout = kv_query_timeout
        self._attempts: dict[str, _Attempt] = {}
        self._tracer = tracer("kvmesh.router")
        self.nc: nats.NATS
        self.store: EtcdStore
        self.directory: WorkerDirectory

    async def start(self) -> None:
        self.nc, self.store = await connect_mesh(self.mesh, f"router-{self.router_id}")
        self.directory = WorkerDirectory(self.store, self.keys)
        self.directory.on_change(self._worker_changed)
        await self.directory.start()
        await self.nc.subscribe(self.subjects.load, cb=self._handle_load)
        await self.nc.subscribe(self.subjects.stream(self.router_id, "*"), cb=self._handle_event)

    async def close(self) -> None:
        await self.directory.stop()
        await self.nc.drain()
        await self.store.close()

    # -- what the HTTP layer reads ---------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        lengths = [w.max_model_len for w in self.directory.workers.values() if w.role == "decode"]
        return min(lengths) if lengths else self._model_max_len

    async def health(self) -> dict[str, int]:
        return {role: len(self.directory.alive(role)) for role in ("prefill", "decode")}

    # -- NATS callbacks ------------------------------------------------------------------
    async def _handle_load(self, msg: Msg) -> None:
        try:
            self.board.update(LoadReport.decode(msg.data))
        except ValidationError:
            logger.debug("malformed load report")

    async def _handle_event(self, msg: Msg) -> None:
        attempt = self._attempts.get(msg.subject.rsplit(".", 1)[-1])
        if attempt is None:
            return
        try:
            attempt.events.put_nowait(TokenEvent.decode(msg.data))
        except ValidationError:
            logger.warning("malformed token event on %s", msg.subject)

    def _worker_changed(self, worker_id: str, record: WorkerRecord | None) -> None:
        if record is not None:
            return
        self.board.forget(worker_id)
        for attempt in self._attempts.values():
            if attempt.decode_worker == worker_id:
                attempt.events.put_nowait(_WORKER_GONE)

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
        excluded: set[str] = set()
        last_reason = "no attempt made"
        try:
            for attempt_number in range(self.max_attempts):
                attempt_id = f"{request_id}-{attempt_number}"
                span.set_attribute("kvmesh.attempts", attempt_number + 1)
                attempt_sampling = sampling.model_copy(update={"max_tokens": progress.remaining_tokens})
                attempt = self._attempt(
                    attempt_id, prompt_token_ids + progress.emitted, attempt_sampling, excluded, span, ctx, session_id
                )
                try:
                    async with contextlib.aclosing(attempt) as events:  # closing cancels the attempt at once
                        async for tokens in events:
                            if attempt_number == 0 and tokens.num_cached_tokens:
                                progress.num_cached_tokens = tokens.num_cached_tokens
                            event = progress.add(tokens.token_ids, tokens.finish_reason if tokens.finished else None)
                            if event is not None:
                                yield event
                            if progress.finished:
                                return
                    raise _Retry("the stream ended without a last event", None)
                except _Retry as retry:
                    last_reason = str(retry)
                    span.add_event("retry", {"reason": last_reason, "tokens_sent": len(progress.emitted)})
                    if retry.bad_worker:
                        excluded.add(retry.bad_worker)
                    logger.warning(
                        "request %s attempt %d failed after %d tokens (%s); retrying",
                        request_id,
                        attempt_number,
                        len(progress.emitted),
                        retry,
                    )
            raise MeshError("unavailable", f"the request failed after {self.max_attempts} attempts: {last_reason}")
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
        excluded: set[str],
        span: trace.Span,
        ctx,
        session_id: str | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """One try: the first token from a prefill worker, the rest from a decode worker.
        Yields events whose token ids are new (their text is ignored: the router
        detokenizes)."""
        decode = least_loaded(self.directory.alive("decode"), self.board, excluded)
        if decode is None:
            raise MeshError("unavailable", "no decode worker is available")
        routed = await self._choose_prefill(attempt_id, prompt, excluded, session_id, span)
        prefill, peer = routed if routed is not None else (None, None)
        span.set_attribute("kvmesh.decode_worker", decode.worker.worker_id)
        span.set_attribute("kvmesh.decode_choice", decode.reason)
        span.set_attribute("kvmesh.prefill_worker", prefill.worker.worker_id if prefill else "")
        request = DecodeRequest(
            request_id=attempt_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            reply_subject=self.subjects.stream(self.router_id, attempt_id),
        )
        attempt = _Attempt(attempt_id, decode.worker.worker_id, prefill.worker.worker_id if prefill else None)
        self._attempts[attempt_id] = attempt
        self.board.add(decode.worker.worker_id, 1)
        finished = False
        try:
            first_sent = False
            if prefill is not None:
                response = await self._prefill(prefill.worker, attempt_id, prompt, sampling, ctx, peer)
                request = request.model_copy(
                    update={
                        "first_token_id": response.first_token_id,
                        "kv": response.kv,
                        "prefill_cached_tokens": response.num_cached_tokens,
                    }
                )
                first_sent = True
                yield TokenEvent(
                    request_id=attempt_id,
                    seq=-1,
                    token_ids=[response.first_token_id],
                    num_cached_tokens=response.num_cached_tokens,
                )
            await self._start_decode(decode.worker, request, ctx)
            async for event in self._events_in_order(attempt):
                finished = event.finished
                if first_sent and event.token_ids:  # the decode side starts with the prefill's token
                    event = event.model_copy(update={"token_ids": event.token_ids[1:]})
                    first_sent = False
                yield event
        finally:
            self.board.add(decode.worker.worker_id, -1)
            self._attempts.pop(attempt_id, None)
            if not finished:
                await self._cancel(attempt_id)

    async def _choose_prefill(
        self, attempt_id: str, prompt: list[int], excluded: set[str], session_id: str | None, span: trace.Span
    ) -> tuple[Choice, PeerPrefix | None] | None:
        """The prefill worker with the best weighted score (prefix cached there, load,
        session affinity, ...), as the routing config says. The decision and every score
        go on the request's span."""
        records = {
            w.worker_id: w
            for w in self.directory.alive("prefill")
            if w.worker_id not in excluded and self.board.usable(w.worker_id)
        }
        if not records:
            return None
        layout = next(iter(records.values())).kv_layout
        block_size = layout.block_size if layout else 16
        matches = await self._prefix_matches(prompt, block_size)
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
        route_span.end()
        return Choice(records[decision.worker_id], f"score {decision.total:.1f}, {cached} prefix blocks cached"), peer

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

    async def _prefix_matches(self, prompt: list[int], block_size: int) -> dict[str, int]:
        """kv-metadata's answer for the prompt's block chain; empty when it is not running
        or does not answer in time (routing then goes on load alone)."""
        if not self.directory.alive("kv-metadata"):
            return {}
        chain = [hash_to_hex(h) for h in hash_token_blocks(prompt, block_size, (self.model_name,))]
        if not chain:
            return {}
        try:
            reply = await self.nc.request(self.subjects.kv_query, KVQuery(block_hashes=chain).encode(), timeout=self.kv_query_timeout)
            return KVQueryReply.decode(reply.data).matches
        except (NatsTimeoutError, NoRespondersError, asyncio.TimeoutError, ValidationError) as exc:
            logger.debug("kv-metadata did not answer: %r", exc)
            return {}

    async def _prefill(
        self,
        worker: WorkerRecord,
        attempt_id: str,
        prompt: list[int],
        sampling: SamplingSpec,
        ctx,
        peer: PeerPrefix | None = None,
    ) -> PrefillResponse:
        self.board.add(worker.worker_id, 1)
        try:
            with self._tracer.start_as_current_span("prefill_call", context=ctx) as span:
                span.set_attribute("kvmesh.worker_id", worker.worker_id)
                payload = PrefillRequest(request_id=attempt_id, prompt_token_ids=prompt, sampling=sampling, peer=peer)
                try:
                    msg = await self.nc.request(
                        worker.subject, payload.encode(), timeout=self.mesh.request_timeout, headers=inject_headers()
                    )
                except (NatsTimeoutError, NoRespondersError, asyncio.TimeoutError) as exc:
                    await self._cancel(attempt_id)
                    raise _Retry(f"prefill on {worker.worker_id}: {type(exc).__name__}", worker.worker_id) from None
        finally:
            self.board.add(worker.worker_id, -1)
        response = PrefillResponse.decode(msg.data)
        if response.error is not None:
            if response.error.code in RETRYABLE:
                raise _Retry(f"prefill on {worker.worker_id}: {response.error.message}", worker.worker_id)
            raise MeshError(response.error.code, response.error.message)
        return response

    async def _start_decode(self, worker: WorkerRecord, request: DecodeRequest, ctx) -> None:
        try:
            msg = await self.nc.request(
                worker.subject, request.encode(), timeout=min(5.0, self.mesh.request_timeout), headers=inject_headers(ctx)
            )
        except (NatsTimeoutError, NoRespondersError, asyncio.TimeoutError) as exc:
            raise _Retry(f"decode on {worker.worker_id}: {type(exc).__name__}", worker.worker_id) from None
        ack = DecodeAck.decode(msg.data)
        if not ack.accepted:
            error = ack.error
            if error is None or error.code in RETRYABLE:
                raise _Retry(f"decode on {worker.worker_id} refused: {error.message if error else '?'}", worker.worker_id)
            raise MeshError(error.code, error.message)

    async def _events_in_order(self, attempt: _Attempt) -> AsyncIterator[TokenEvent]:
        """The attempt's events by sequence number, until the last one."""
        expected = 0
        early: dict[int, TokenEvent] = {}
        while True:
            try:
                item = await asyncio.wait_for(attempt.events.get(), self.mesh.request_timeout)
            except asyncio.TimeoutError:
                raise _Retry(f"no token from {attempt.decode_worker} for {self.mesh.request_timeout:g}s", attempt.decode_worker) from None
            if item is _WORKER_GONE:
                raise _Retry(f"decode worker {attempt.decode_worker} is gone", attempt.decode_worker)
            early[item.seq] = item
            while expected in early:
                event = early.pop(expected)
                expected += 1
                if event.error is not None:
                    if event.error.code == "unavailable":  # the pull failed: the prefill side is gone
                        raise _Retry(event.error.message, attempt.prefill_worker)
                    if event.error.code in RETRYABLE:
                        raise _Retry(event.error.message, attempt.decode_worker)
                    raise MeshError(event.error.code, event.error.message)
                yield event
                if event.finished:
                    return

    async def _cancel(self, attempt_id: str) -> None:
        try:
            await self.nc.publish(self.subjects.cancel, CancelRequest(request_id=attempt_id).encode())
        except Exception as exc:  # noqa: BLE001 - best effort; leases and timeouts clean up
            logger.debug("cancel of %s not sent: %s", attempt_id, exc)
