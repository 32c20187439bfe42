"""The decode worker: pulls a prefill's KV blocks through the Mooncake transfer engine,
releases the pin, decodes with continuous batching across requests and streams numbered
token events to the router. Without a KV handle it prefills the prompt itself.

Everything about a request (the ack, progress, token events) goes to the NATS reply
subject of the work message: the only subject NATS lets this worker publish it on."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg
from pydantic import ValidationError

from kvmesh.errors import ErrorCode, MeshError
from kvmesh.protocol import QUEUE_GROUP, DecodeAck, DecodeRequest, ErrorInfo, LogprobSpec, ReleaseRequest, Stage, TokenEvent, request_id_of
from kvmesh.services.decode_worker.handle_check import check_handle, producer_layout
from kvmesh.services.decode_worker.import_line import ImportLine
from kvmesh.telemetry import extract_context, inject_headers, record_queue_wait
from kvmesh.transfer.mooncake_agent import TransferError
from kvmesh.transfer.runs import coalesce
from kvmesh.worker.in_flight import InFlight
from kvmesh.worker.pin_release import CONFIRM_RELEASE_AFTER, release_confirmed
from kvmesh.worker.engine_api import EngineDeadError, FinishReason, SamplingParams
from kvmesh.worker.runtime import WorkerRuntime
from kvmesh.service_main import start_service
from kvmesh.settings.worker import worker_settings

logger = logging.getLogger(__name__)

IMPORT_RETRY_INTERVAL = 0.05  # seconds between tries for blocks while the pool is full
RESUMED_IMPORT_WAIT = 1.0  # seconds a retried request waits for room here before trying elsewhere
PIN_MARGIN = 5.0  # seconds of a prefill's pin left for the pull itself when a wait for room ends


class DecodeWorker:
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.in_flight = InFlight()  # requests waiting for room or pulling, not in the engine yet
        self.import_line = ImportLine()  # pulls waiting for room, in the order they take it
        runtime.queued_outside_engine = lambda: len(self.import_line)

    async def start(self) -> None:
        rt = self.runtime
        await rt.start()
        rt.on_cancel = self._cancel
        await rt.subscribe_work(rt.subjects.decode(rt.worker_id), self._handle_decode)
        await rt.subscribe_work(rt.subjects.decode(), self._handle_decode, queue=QUEUE_GROUP["decode"])
        await rt.register()

    async def _handle_decode(self, msg: Msg) -> None:
        if not msg.reply:
            logger.warning("dropped a decode request without a reply subject")
            return
        try:
            request = DecodeRequest.decode(msg.data)
        except ValidationError as exc:
            error = ErrorInfo(code=ErrorCode.BAD_REQUEST, message=str(exc))
            await msg.respond(DecodeAck(request_id=request_id_of(msg.data), accepted=False, error=error).encode())
            return
        if self.runtime.draining:
            error = ErrorInfo(code=ErrorCode.UNAVAILABLE, message="worker is draining")
            await msg.respond(DecodeAck(request_id=request.request_id, accepted=False, error=error).encode())
            return
        self.in_flight.start(request.request_id)
        await msg.respond(DecodeAck(request_id=request.request_id, accepted=True).encode())
        self.runtime.spawn(self._decode(request, msg.reply, msg.headers), name=f"decode {request.request_id}")

    async def _cancel(self, request_id: str) -> None:
        self.in_flight.cancel(request_id)  # seen before the engine is handed the request
        await self.runtime.engine.abort(request_id)  # or the engine stops it

    async def _decode(self, request: DecodeRequest, reply: str, headers: dict[str, str] | None) -> None:
        rt = self.runtime
        rid = request.request_id
        seq = 0

        async def send(event: TokenEvent) -> None:
            await rt.nc.publish(reply, event.encode(), headers=inject_headers())

        with rt.tracer.start_as_current_span("decode", context=extract_context(headers)) as span:
            span.set_attribute("kvmesh.worker_id", rt.worker_id)
            span.set_attribute("kvmesh.request_id", rid)
            stage: Stage = "pull" if request.kv is not None else "prefill"
            async with rt.heartbeat(reply, rid, stage) as beat:
                try:
                    cached = None
                    if request.kv is not None:
                        cached = request.prefill_cached_tokens  # what the prefill reused, not the import
                        first_token = await self._pull(request)
                        beat.stage = "decode"
                        self._check_cancelled(rid)
                        stream = rt.engine.generate_from_import(
                            rid, request.prompt_token_ids, first_token, rid, request.sampling.to_params()
                        )
                    else:
                        span.set_attribute("kvmesh.local_prefill", True)
                        self._check_cancelled(rid)
                        stream = rt.engine.generate(
                            rid, request.prompt_token_ids, request.sampling.to_params(), first=request.resumed
                        )
                    # From the first iteration the engine has the request (its submission is
                    # queued before this task next yields), so a later cancel aborts it there.
                    async for out in stream:
                        self.in_flight.done(rid)
                        beat.stage = "decode"
                        if out.queue_seconds is not None and request.kv is None:
                            record_queue_wait(rt.tracer, span, out.queue_seconds)
                        if out.finish_reason is FinishReason.ERROR:
                            code = out.error_code or ErrorCode.REQUEST_FAILED  # internal: its batch failed
                            raise MeshError(code, out.error or "the engine failed this request")
                        await send(
                            TokenEvent(
                                request_id=rid,
                                seq=seq,
                                token_ids=out.new_token_ids,
                                text=out.text,
                                finished=out.finished,
                                finish_reason=out.finish_reason.value if out.finish_reason else None,
                                num_prompt_tokens=out.num_prompt_tokens,
                                num_cached_tokens=cached if cached is not None else out.num_cached_tokens,
                                logprobs=LogprobSpec.many(out.logprobs),
                                prompt_logprobs=LogprobSpec.many(out.prompt_logprobs),
                            )
                        )
                        seq += 1
                    span.set_attribute("kvmesh.output_events", seq)
                except Exception as exc:  # noqa: BLE001 - every failure ends the stream with an error event
                    span.record_exception(exc)
                    code = error_code(exc)
                    if code is ErrorCode.INTERNAL:
                        logger.exception("request %s failed", rid)
                    else:
                        logger.warning("request %s failed: %s", rid, exc)
                    error = ErrorInfo(code=code, message=str(exc))
                    await send(TokenEvent(request_id=rid, seq=seq, finished=True, error=error))
                    if request.kv is not None:
                        await self._release_unused_import(rid)
                finally:
                    self.in_flight.done(rid)

    def _check_cancelled(self, request_id: str) -> None:
        if self.in_flight.is_cancelled(request_id):
            raise MeshError(ErrorCode.CANCELLED, "cancelled before decoding started")

    async def _release_unused_import(self, request_id: str) -> None:
        """Blocks pulled for a request the engine then refused are given back (a no-op
        once the engine took them over)."""
        try:
            await self.runtime.engine.release_import(request_id)
        except Exception as exc:  # noqa: BLE001 - a dead engine frees nothing more
            logger.debug("releasing the import of %s failed: %s", request_id, exc)

    async def _pull(self, request: DecodeRequest) -> int:
        """Blocks for the prompt's KV, one batched read of the prefill's blocks, pin released.
        The handle is checked before anything is allocated; whatever fails after the
        allocation gives the blocks back. Returns the prefill's first token."""
        rt = self.runtime
        kv = request.kv
        assert kv is not None and rt.directory is not None
        local = rt.engine.kv_layout
        ok = confirmed = False
        bytes_pulled, seconds_pulled = 0, 0.0
        loop = asyncio.get_running_loop()
        came = loop.time()
        try:
            producer = rt.directory.workers.get(kv.prefill_worker_id)
            check_handle(
                request,
                producer,
                local,
                vocab_size=rt.engine.vocab_size,
                pin_key=rt.keys.pin(kv.prefill_worker_id, request.request_id),
            )
            if rt.settings.fault_pull_delay:
                await asyncio.sleep(rt.settings.fault_pull_delay)
            with rt.tracer.start_as_current_span("kv_transfer") as span:
                block_ids = await self._allocate_import(
                    request.request_id, kv.num_tokens, request.sampling.to_params(), resumed=request.resumed, pin_ttl=kv.pin_ttl
                )
                # A cancel while waiting for room or reading the blocks gives them back (below).
                try:
                    runs = coalesce(kv.block_ids, block_ids)
                    stats = await rt.agent.read_layout_async(
                        kv.transfer_endpoint, runs, peer=producer_layout(producer), local=local
                    )
                except BaseException:
                    await rt.engine.release_import(request.request_id)
                    raise
                bytes_pulled, seconds_pulled = stats.bytes, stats.seconds
                rt.transferred("in", stats.bytes, stats.seconds)
                span.set_attribute("kvmesh.peer", kv.prefill_worker_id)
                span.set_attribute("kvmesh.bytes", stats.bytes)
                span.set_attribute("kvmesh.blocks", len(block_ids))
                span.set_attribute("kvmesh.ranges", stats.ranges)
                span.set_attribute("kvmesh.seconds", stats.seconds)
                ok = True
                if loop.time() - came >= CONFIRM_RELEASE_AFTER:
                    confirmed = True
                    await self._release_confirmed(request.request_id, kv.prefill_worker_id, kv.pin_token, bytes_pulled, seconds_pulled)
                assert request.first_token_id is not None  # check_handle saw to it
                return request.first_token_id
        finally:
            if not confirmed:
                release = ReleaseRequest(request_id=request.request_id, pin_token=kv.pin_token, bytes_pulled=bytes_pulled, seconds_pulled=seconds_pulled, ok=ok)
                try:
                    await rt.nc.publish(rt.subjects.release(kv.prefill_worker_id), release.encode())
                except Exception as exc:  # noqa: BLE001 - the pin's lease frees the blocks anyway
                    logger.warning("could not release the pin of %s: %s", request.request_id, exc)

    async def _release_confirmed(self, request_id: str, producer: str, pin_token: str, bytes_pulled: int, seconds_pulled: float) -> None:
        """Release a late pull's pin and hear that it was still held; else raise ``kv_lost``
        (its blocks may be another request's by now: retried; the caller frees ours)."""
        rt = self.runtime
        release = ReleaseRequest(request_id=request_id, pin_token=pin_token, bytes_pulled=bytes_pulled, seconds_pulled=seconds_pulled, ok=True)
        held, why = await release_confirmed(rt.nc, rt.subjects.release(producer), release, min(2.0, rt.timeout))
        if not held:
            raise MeshError(ErrorCode.KV_LOST, f"{producer}, {request_id}: {why}")

    async def _allocate_import(
        self, request_id: str, num_tokens: int, params: SamplingParams, *, resumed: bool = False, pin_ttl: float | None = None
    ) -> list[int]:
        """Blocks for an import. A new request is admitted only while every running one
        still has room to grow by a block, and where the engine's own admission takes it
        (kvmesh's keeps room for the running requests' expected growth): else they would
        preempt each other and recompute, and nobody gets anywhere. A ``resumed`` stream,
        whose client is mid-answer, only needs the blocks. While there is no room, wait in line (``ImportLine``) up to ``import_wait``
        seconds (and 5 s less than the prefill's pin lasts: ``pin_ttl``, the producer's, from
        the handle; this worker's own where the handle has none) for running requests to give
        some back (the router hears heartbeats meanwhile)."""
        rt = self.runtime
        loop = asyncio.get_running_loop()
        # A retry waits less: another decode worker (one just restarted, say) may have room.
        # No wait outlives the prefill's pin of the blocks to pull.
        wait = min(rt.settings.import_wait, max(1.0, (pin_ttl or rt.settings.pin_ttl) - PIN_MARGIN))
        give_up = loop.time() + (min(RESUMED_IMPORT_WAIT, wait) if resumed else wait)
        needed = -(-num_tokens // rt.engine.kv_layout.block_size)
        ticket = self.import_line.join(retried=resumed)
        try:
            while True:
                self._check_cancelled(request_id)
                if self.import_line.is_first(ticket):
                    load = rt.engine.load_now()
                    reserve = 0 if resumed else load["running"]
                    if load["free_blocks"] - needed >= reserve:
                        block_ids = await rt.engine.allocate_import(request_id, num_tokens, params, resumed)
                        if block_ids is not None:
                            return block_ids
                if loop.time() >= give_up:
                    raise MeshError(ErrorCode.OVERLOADED, f"no room for the KV of {num_tokens} tokens")
                await asyncio.sleep(IMPORT_RETRY_INTERVAL)
        finally:
            self.import_line.leave(ticket)


def error_code(exc: BaseException) -> ErrorCode:
    """The mesh's code for a failure while serving a decode request."""
    if isinstance(exc, MeshError):
        return exc.code
    if isinstance(exc, TransferError):
        return ErrorCode.KV_LOST  # the prefill worker or its blocks are gone: retry elsewhere
    if isinstance(exc, EngineDeadError):
        return ErrorCode.UNAVAILABLE  # this worker is going away
    if isinstance(exc, ValueError):
        return ErrorCode.BAD_REQUEST  # the engine refused the request (too long, bad ids)
    return ErrorCode.INTERNAL


async def main(argv: list[str] | None = None) -> int:
    settings = worker_settings("decode", argv)
    runtime = WorkerRuntime(settings)
    await start_service("decode worker", settings, instance="worker_id", prepare=runtime.prepare)
    worker = DecodeWorker(runtime)
    try:
        await worker.start()
    except BaseException:
        await runtime.abandon_identity()
        raise
    return await runtime.serve_until_signalled()
