"""The prefill worker: runs prompts into paged KV blocks (reusing cached prefixes), answers
with the first token and a handle to the blocks, and holds them under a pin until the
decode side has pulled them.

A release counts only with the pin's token from the handle; a lend names its borrower in
its subject (NATS lets a worker name only itself there) and a borrower may hold at most
``LEND_CAP_FRACTION`` of this worker's pool at a time."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg
from opentelemetry import trace
from pydantic import ValidationError

from kvmesh.errors import ErrorCode, KvmeshError
from kvmesh.protocol import (
    QUEUE_GROUP,
    ErrorInfo,
    KVHandle,
    KVLayoutSpec,
    PrefillRequest,
    PrefillResponse,
    ReleaseReply,
    ReleaseRequest,
    Subjects,
)
from kvmesh.hashing import hash_from_hex
from kvmesh.protocol import KVLendReply, KVLendRequest, LogprobSpec, request_id_of
from kvmesh.services.prefill_worker.peer_prefix import CostModel, borrow_handle, borrow_prefix
from kvmesh.services.prefill_worker.pins import PinTable
from kvmesh.telemetry import extract_context, record_queue_wait, record_span
from kvmesh.worker.in_flight import InFlight
from kvmesh.worker.engine_api import EngineDeadError, FinishReason, RequestOutput
from kvmesh.worker.runtime import WorkerRuntime
from kvmesh.service_main import start_service
from kvmesh.settings.worker import worker_settings

logger = logging.getLogger(__name__)

LEND_CAP_FRACTION = 0.25  # of this worker's blocks, held for any one borrower at a time


class PrefillWorker:
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.pins: PinTable
        self.cost = CostModel()
        self.in_flight = InFlight()
        self._lending = asyncio.Lock()  # a borrower's holdings checked and taken as one step
        self.started_at = 0.0  # this incarnation's, as in the etcd record

    async def start(self) -> None:
        rt = self.runtime
        await rt.start()
        self.pins = PinTable(
            rt.store, rt.keys.pins(rt.worker_id), rt.settings.pin_ttl, rt.engine.release_export, write_delay=rt.settings.pin_write_delay
        )
        await self.pins.start()
        rt.on_close(self.pins.stop)
        rt.pin_count = lambda: len(self.pins)
        rt.on_cancel = self._cancel
        self.started_at = rt.record().started_at
        await rt.nc.subscribe(rt.subjects.release(rt.worker_id), cb=rt.control.wrap(self._handle_release))
        await rt.nc.subscribe(rt.subjects.kv_lend(rt.worker_id, "*"), cb=rt.control.wrap(self._handle_lend))
        await rt.subscribe_work(rt.subjects.prefill(rt.worker_id), self._handle_prefill)
        await rt.subscribe_work(rt.subjects.prefill(), self._handle_prefill, queue=QUEUE_GROUP["prefill"])
        await rt.register()

    async def _handle_prefill(self, msg: Msg) -> None:
        self.runtime.spawn(self._prefill(msg), name="prefill")

    async def _prefill(self, msg: Msg) -> None:
        rt = self.runtime
        try:
            request = PrefillRequest.decode(msg.data)
        except ValidationError as exc:
            await msg.respond(PrefillResponse(request_id=request_id_of(msg.data), error=ErrorInfo(code=ErrorCode.BAD_REQUEST, message=str(exc))).encode())
            return
        rid = request.request_id
        self.in_flight.start(rid)
        async with rt.heartbeat(msg.reply or None, rid, "prefill"):
            try:
                await self._prefill_request(msg, request)
            except Exception as exc:  # noqa: BLE001 - the router hears of every failure
                logger.exception("prefill of %s failed", rid)
                error = ErrorInfo(code=ErrorCode.INTERNAL, message=f"prefill failed: {exc!r}")
                await msg.respond(PrefillResponse(request_id=rid, error=error).encode())
            finally:
                self.in_flight.done(rid)
                if request.peer is not None:
                    await self._give_back_borrowed(rid)

    async def _give_back_borrowed(self, rid: str) -> None:
        """Blocks a peer's prefix was pulled into that the prefill did not take (it never
        ran, say) go back (a no-op for an engine that cached them at once)."""
        try:
            await self.runtime.engine.release_import(borrow_handle(rid))
        except Exception as exc:  # noqa: BLE001 - a dead engine frees nothing more
            logger.debug("giving back the borrowed blocks of %s failed: %s", rid, exc)

    async def _prefill_request(self, msg: Msg, request: PrefillRequest) -> None:
        rt = self.runtime
        rid = request.request_id
        with rt.tracer.start_as_current_span("prefill", context=extract_context(msg.headers)) as span:
            span.set_attribute("kvmesh.worker_id", rt.worker_id)
            span.set_attribute("kvmesh.request_id", rid)
            span.set_attribute("kvmesh.prompt_tokens", len(request.prompt_token_ids))
            if request.peer is not None and not self.in_flight.is_cancelled(rid):
                with rt.tracer.start_as_current_span("peer_pull") as pull_span:
                    await borrow_prefix(rt, self.cost, rid, request.prompt_token_ids, request.peer, pull_span)
            if self.in_flight.is_cancelled(rid):  # before or while borrowing: the engine never saw it
                await self._respond_cancelled(msg, rid)
                return
            started = time.perf_counter()
            try:
                out = await rt.engine.prefill_export(
                    rid, request.prompt_token_ids, request.sampling.to_params(), first=request.resumed
                )
            except (ValueError, KvmeshError) as exc:
                span.record_exception(exc)
                code = ErrorCode.UNAVAILABLE if isinstance(exc, EngineDeadError) else ErrorCode.BAD_REQUEST
                await msg.respond(PrefillResponse(request_id=rid, error=ErrorInfo(code=code, message=str(exc))).encode())
                return
            if out.finish_reason is FinishReason.ERROR:
                code = out.error_code or ErrorCode.REQUEST_FAILED  # internal (retried) when its whole batch failed
                error = ErrorInfo(code=code, message=out.error or "the engine failed this request")
                await msg.respond(PrefillResponse(request_id=rid, error=error).encode())
                return
            prefill_seconds = time.perf_counter() - started
            try:
                await self._answer(msg, rid, out)
            finally:  # the books, once the answer is on its way
                if out.queue_seconds is not None:
                    record_queue_wait(rt.tracer, span, out.queue_seconds)
                span.set_attribute("kvmesh.cached_tokens", out.num_cached_tokens)
                span.set_attribute("kvmesh.computed_tokens", out.num_prompt_tokens - out.num_cached_tokens)
                self.cost.observe_prefill(out.num_prompt_tokens - out.num_cached_tokens, prefill_seconds)

    async def _answer(self, msg: Msg, rid: str, out: RequestOutput) -> None:
        """The router's answer to a prefill the engine finished: the first token and a handle
        to the blocks, pinned until they are pulled (or why there is none)."""
        rt = self.runtime
        if out.finish_reason is FinishReason.ABORT or out.kv_export is None:
            await msg.respond(PrefillResponse(request_id=rid, error=ErrorInfo(code=ErrorCode.CANCELLED, message="aborted")).encode())
            return
        export = out.kv_export
        if self.in_flight.is_cancelled(rid):  # cancelled after the engine finished it: nobody will pull
            await rt.engine.release_export(rid)
            await self._respond_cancelled(msg, rid)
            return
        layout = rt.engine.kv_layout
        pinning = time.time_ns()
        pin = self.pins.pin(rid, rt.worker_id.encode(), len(export.block_ids) * layout.moved_block_bytes)
        pinned = time.time_ns()
        handle = KVHandle(
            prefill_worker_id=rt.worker_id,
            transfer_endpoint=rt.agent.endpoint,
            kv_base_address=layout.base_address,
            layout=KVLayoutSpec.from_layout(layout),
            block_ids=export.block_ids,
            num_tokens=export.num_tokens,
            pin_key=rt.keys.pin(rt.worker_id, rid),
            pin_token=pin.token,
            producer_started_at=self.started_at,
            pin_ttl=float(rt.settings.pin_ttl),
        )
        response = PrefillResponse(
            request_id=rid,
            first_token_id=out.new_token_ids[0],
            num_cached_tokens=out.num_cached_tokens,
            kv=handle,
            first_logprob=(LogprobSpec.many(out.logprobs) or [None])[0],
            prompt_logprobs=LogprobSpec.many(out.prompt_logprobs),
        )
        try:
            await msg.respond(response.encode())
        except Exception as exc:  # noqa: BLE001 - the router gave up on us: nobody will pull
            logger.warning("the answer to %s could not be sent (%s); unpinning", rid, exc)
            await self.pins.release(rid, reason="router gone")
        finally:  # the pin's span, once the answer is on its way
            record_span(rt.tracer, trace.get_current_span(), "pin", pinning, pinned, {"kvmesh.blocks": len(export.block_ids)})

    async def _respond_cancelled(self, msg: Msg, rid: str) -> None:
        logger.info("prefill of %s cancelled before its pin", rid)
        await msg.respond(PrefillResponse(request_id=rid, error=ErrorInfo(code=ErrorCode.CANCELLED, message="cancelled")).encode())

    async def _handle_release(self, msg: Msg) -> None:
        try:
            release = ReleaseRequest.decode(msg.data)
        except ValidationError:
            return
        pin = await self.pins.release_with_token(
            release.request_id, release.pin_token, reason="pulled" if release.ok else "pull failed"
        )
        if pin is not None and release.ok:
            self.runtime.bytes_served += release.bytes_pulled
            self.runtime.transferred("out", release.bytes_pulled, release.seconds_pulled)
        if msg.reply:  # the puller asks whether the blocks were still pinned all along
            await msg.respond(ReleaseReply(released=pin is not None).encode())

    async def _handle_lend(self, msg: Msg) -> None:
        """A peer pulls our cached prefix blocks: hold them (under a pin, so a peer that dies
        mid-pull cannot leak them) and say where they are. The borrower is the subject's
        last token; what it may hold here at once is capped."""
        rt = self.runtime
        layout = rt.engine.kv_layout
        borrower = Subjects.sender(msg.subject)
        cap = max(1, int(layout.num_blocks * LEND_CAP_FRACTION))
        block_ids: list[int] = []
        error: ErrorInfo | None = None
        loan_id = token = ""
        try:
            lend = KVLendRequest.decode(msg.data)
            hashes = [hash_from_hex(h) for h in lend.block_hashes]
        except (ValidationError, ValueError) as exc:
            logger.info("refusing a lend request from %s: %s", borrower, exc)
            error = ErrorInfo(code=ErrorCode.BAD_REQUEST, message=str(exc))
        else:
            async with self._lending:
                block_ids, loan_id, token, error = await self._lend(borrower, lend.handle, hashes, cap)
        reply = KVLendReply(
            block_ids=block_ids,
            transfer_endpoint=rt.agent.endpoint,
            kv_base_address=layout.base_address,
            layout=KVLayoutSpec.from_layout(layout),
            loan_id=loan_id if block_ids else "",
            pin_token=token,
            error=error,
        )
        await msg.respond(reply.encode())

    async def _lend(self, borrower: str, handle: str, hashes: list[int], cap: int) -> tuple[list[int], str, str, ErrorInfo | None]:
        """Hold what ``borrower`` may still hold here of ``hashes``' leading cached blocks:
        (block ids, loan id, pin token, error)."""
        rt = self.runtime
        loan_id = f"lend:{borrower}:{handle}"  # never a request's id, nor another borrower's
        held = self.pins.lent_to(borrower)
        if loan_id in self.pins.pins:
            return [], loan_id, "", ErrorInfo(code=ErrorCode.BAD_REQUEST, message=f"loan {handle} is already held")
        if held >= cap:
            logger.warning("refused a lend to %s: it holds %d blocks here, the cap is %d", borrower, held, cap)
            message = f"{borrower} holds {held} of at most {cap} lent blocks here"
            return [], loan_id, "", ErrorInfo(code=ErrorCode.OVERLOADED, message=message)
        try:  # at most up to the cap: the borrower computes the rest
            block_ids = await rt.engine.lend_cached_blocks(loan_id, hashes[: cap - held])
        except ValueError as exc:
            return [], loan_id, "", ErrorInfo(code=ErrorCode.BAD_REQUEST, message=str(exc))
        if not block_ids:
            await rt.engine.release_export(loan_id)  # an empty hold
            return [], loan_id, "", None
        num_bytes = len(block_ids) * rt.engine.kv_layout.moved_block_bytes
        pin = self.pins.pin(loan_id, rt.worker_id.encode(), num_bytes, borrower=borrower, num_blocks=len(block_ids))
        return block_ids, loan_id, pin.token, None

    async def _cancel(self, request_id: str) -> None:
        self.in_flight.cancel(request_id)
        await self.runtime.engine.abort(request_id)
        await self.pins.release(request_id, reason="cancelled")


async def main(argv: list[str] | None = None) -> int:
    settings = worker_settings("prefill", argv)
    runtime = WorkerRuntime(settings)
    await start_service("prefill worker", settings, instance="worker_id", prepare=runtime.prepare)
    worker = PrefillWorker(runtime)
    try:
        await worker.start()
    except BaseException:
        await runtime.abandon_identity()
        raise
    return await runtime.serve_until_signalled()
