"""vLLM's synchronous engine (``vllm.v1.engine.llm_engine.LLMEngine``, its engine core in
this process) with the face ``kvmesh.engine.async_engine.AsyncEngine`` drives on its
thread: add, step, abort, load, pool stats and KV events in kvmesh's terms, and with
kvmesh's KV connector (``vllm_connector``, sharing an ``Exchange``) prefill for export and
decode from imported KV: an export's blocks are the ones vLLM keeps for it; an import is
pulled into blocks taken from vLLM's pool, whose whole blocks are then named in vLLM's prefix
cache under the request's own hashes (vLLM uses them in place), and whose part block is
copied, between steps, into the block vLLM's scheduler allocates for it.

The one module that knows vLLM's insides (with ``vllm_engine``): the scheduler's queues
and block pool for load and stats, the model runner's KV tensors for the pool's layout, and
the scheduler's KV event publisher, replaced by one that queues vLLM's ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` here, where they are renamed with kvmesh's block
hashes (``vllm_events``: the mesh's one function, from the events' token ids). Every call runs on the
engine thread; only ``load`` is read from elsewhere, as a fresh dict.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from kvmesh.engine.block_pool import KVCacheEvent
from kvmesh.engine.kv_cache_manager import PoolStats
from kvmesh.engine.kv_layout import KVLayout
from kvmesh.engine.outputs import KVExport, RequestOutput
from kvmesh.engine.request import FinishReason, SamplingParams, TokenLogprob
from kvmesh.errors import ErrorCode
from kvmesh.hashing import BlockHash, hash_token_blocks
from kvmesh.transfer.layout import PoolLayout
from kvmesh.worker.kv_tensors import copy_blocks
from kvmesh.worker.vllm_events import EventQueue, KVEventNames
from kvmesh.worker.vllm_exchange import EXPORT, FROM_TOKEN, IMPORT, NUM_TOKENS, Exchange
from kvmesh.worker.vllm_outputs import FORCED, logprobs_of, prompt_logprobs_of, structured_outputs_kwargs
from kvmesh.worker.vllm_stats import VllmStats

logger = logging.getLogger(__name__)

FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT, "error": FinishReason.ERROR}


class UnsupportedByVllm(ValueError):
    """A hook the vLLM engine does not have without the connector: any export or import."""


@dataclass(slots=True)
class PrefixImport:
    """Blocks a peer's prefix was pulled into (``cache_imported_blocks``), waiting for the
    prefill that asked for them: kvmesh's hashes of the blocks they hold, in chain order."""

    blocks: list[Any]
    hashes: list[BlockHash]


class VllmCore:
    """One in-process vLLM engine, called on one thread only (``AsyncEngine``'s); with
    ``exchange`` (``kvmesh.worker.vllm_connector``) it exports and imports KV blocks."""

    # 1 while vLLM has requests (it waits for room on its own); 0 after a step for the
    # connector alone, so that the engine thread waits for a command before the next
    last_step_tokens = 1

    def __init__(
        self,
        engine: Any,
        model_name: str,
        layout: PoolLayout,
        num_threads: int | None,
        exchange: Exchange | None = None,
        *,
        kv_caches: list[Any] | None = None,
    ) -> None:
        from vllm.sampling_params import RequestOutputKind  # type: ignore[import-not-found]

        self.engine = engine
        self.model_name = model_name
        self.layout = layout
        self.block_size = layout.block_size
        self.exchange = exchange
        # the KV tensors, in this process (imports are copied in them): vLLM's one worker's, or,
        # given, every tensor-parallel rank's as mapped here (``kvmesh.worker.shared_pool``)
        driver = getattr(engine.model_executor, "driver_worker", None)
        if kv_caches is None:
            kv_caches = list(driver.worker.model_runner.kv_caches) if driver is not None else []
        self.kv_caches = kv_caches
        self.tokenizer = engine.get_tokenizer()
        self._exports: set[str] = set()  # requests prefilled for export, until their last output
        self._staged: dict[str, list[Any]] = {}  # handle -> vLLM blocks a pull fills (allocate_import)
        self._prefixes: dict[str, PrefixImport] = {}  # handle -> blocks holding a peer's prefix, for a prefill
        # handle -> those blocks, and the prompt block the first holds, once its request is in vLLM
        self._importing: dict[str, tuple[list[Any], int]] = {}
        self._lent: dict[str, list[Any]] = {}  # handle -> cached blocks referenced for a peer's pull
        self._import_of: dict[str, str] = {}  # request id -> its import's handle, until filled or aborted
        self._delta = RequestOutputKind.DELTA
        core = engine.engine_core.engine_core  # EngineCore, in this process
        self.scheduler = core.scheduler
        self.block_pool = self.scheduler.kv_cache_manager.block_pool
        self.events = EventQueue()
        self.scheduler.kv_event_publisher = self.events
        self.names = KVEventNames(self.block_size, model_name)
        self._pending: list[KVCacheEvent] = []
        self._prompts: dict[str, int] = {}  # request id -> prompt tokens, while vLLM has it
        self._num_threads = num_threads
        self._thread_set: int | None = None
        self.blocks_copied = 0  # blocks of imports copied into a request's blocks (the rest used in place)
        # request id -> the tokens vLLM outputs first (forced: ``vllm_forced``) that are not
        # new to kvmesh: a guided request's earlier tokens (and an import's first token)
        self._forced: dict[str, list[int]] = {}
        self._logprobs: dict[str, tuple[int | None, int | None]] = {}  # request id -> (logprobs, prompt_logprobs) it asks
        self.stats = VllmStats()  # what vLLM's stat logger records (``VllmEngine.build`` sets the engine's)

    # -- requests ------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None, *, export_kv: bool = False, first: bool = False
    ) -> None:
        if request_id in self._prompts:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._this_thread()
        params = params or SamplingParams()
        transfer: dict[str, Any] = {EXPORT: request_id} if export_kv else {}
        prompt, forced = self._split_forced(list(prompt_token_ids), params)
        prefix = self._take_prefix(prompt)
        if prefix is not None:  # a prefix pulled from a peer: the connector loads it, vLLM computes the rest
            handle, start, end = prefix
            transfer.update({IMPORT: handle, NUM_TOKENS: end * self.block_size, FROM_TOKEN: start * self.block_size})
        # export: the first token, then the blocks stay for a peer (the connector's request_finished)
        sampling = self.sampling(params, max_tokens=1 if export_kv else None, transfer=transfer or None, forced=forced)
        try:
            vllm_id = self.engine.add_request(request_id, {"prompt_token_ids": prompt}, sampling)
        except BaseException:
            if prefix is not None:
                self._forget_import(prefix[0])
            raise
        if export_kv:
            self._exports.add(request_id)
        if prefix is not None:
            handle, start, end = prefix
            self._adopt(vllm_id, self._importing[handle][0], end * self.block_size, start=start)
            self._import_of[request_id] = handle
        self._track(request_id, params, forced)
        self._prompts[request_id] = len(prompt_token_ids)

    @staticmethod
    def _split_forced(prompt: list[int], params: SamplingParams) -> tuple[list[int], list[int]]:
        """vLLM's prompt, and the tokens it outputs first, forced: a guided request's
        earlier tokens (a resumed one's, at its prompt's end) are output again, so that vLLM's
        grammar, which starts at the first output token, consumes them."""
        m = params.prior_output_tokens if params.guided is not None else 0
        return (prompt[: len(prompt) - m], prompt[len(prompt) - m :]) if m else (prompt, [])

    def _track(self, request_id: str, params: SamplingParams, forced: list[int]) -> None:
        if forced:
            self._forced[request_id] = list(forced)
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self._logprobs[request_id] = (params.logprobs, params.prompt_logprobs)

    def _untrack(self, request_id: str) -> None:
        self._forced.pop(request_id, None)
        self._logprobs.pop(request_id, None)

    def sampling(
        self,
        p: SamplingParams,
        *,
        max_tokens: int | None = None,
        generated: int = 0,
        transfer: dict[str, Any] | None = None,
        forced: list[int] | None = None,
        prompt_logprobs: bool = True,
    ) -> Any:
        """vLLM's sampling parameters for ``p``; ``generated`` tokens at the prompt's end were
        generated already (a resumed request's, an import's first token): min_tokens counts
        them. vLLM's presence and frequency penalties see only the tokens it generates.
        ``forced``: tokens vLLM outputs first (``vllm_forced``), of those generated already,
        on top of ``max_tokens`` new ones. Logprobs are vLLM's raw ones (``vllm_outputs``);
        ``prompt_logprobs=False`` leaves those out (a decode from imported KV: the prefill
        computed them). Structured output goes to vLLM's guidance backend (llguidance)."""
        from vllm import SamplingParams as VllmSamplingParams  # type: ignore[import-not-found]

        forced = list(forced or ())
        structured = None
        if p.guided is not None:  # never dropped: the client asked for output that matches it
            from vllm.sampling_params import StructuredOutputsParams  # type: ignore[import-not-found]

            structured = StructuredOutputsParams(**structured_outputs_kwargs(p.guided))
        generated = max(0, generated + p.prior_output_tokens - len(forced))  # forced ones vLLM outputs, and counts
        limit = (max_tokens or p.max_tokens) + len(forced)
        extra: dict[str, Any] = {"kv_transfer_params": transfer} if transfer else {}
        if forced:
            extra[FORCED] = forced
        return VllmSamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else 0, seed=p.seed,
            max_tokens=limit, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
            ignore_eos=p.ignore_eos, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty, logit_bias=dict(p.logit_bias) or None, min_p=p.min_p,
            min_tokens=min(limit, max(0, p.min_tokens - generated)), output_kind=self._delta,  # vLLM refuses min > max
            extra_args=extra or None, logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs if prompt_logprobs else None,
            structured_outputs=structured,
        )  # fmt: skip

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished_requests()) or (self.exchange is not None and self.exchange.busy())

    def step(self) -> list[RequestOutput]:
        self._this_thread()
        outputs = []
        for out in self.engine.step():
            completion = out.outputs[0] if out.outputs else None
            reason = FINISH_REASONS.get(completion.finish_reason or "stop", FinishReason.STOP) if out.finished and completion else None
            token_ids = list(completion.token_ids) if completion else []
            text = completion.text if completion else ""
            sample_logprobs = completion.logprobs if completion else None
            num_prompt = len(out.prompt_token_ids or ())
            forced = self._forced.get(out.request_id)
            if forced is not None:  # outputs kvmesh has already (``vllm_forced``)
                num_prompt = self._prompts.get(out.request_id, num_prompt)
                take = min(len(forced), len(token_ids))
                if token_ids[:take] != forced[:take]:
                    outputs.append(self._fail_forced(out.request_id, forced[:take], token_ids[:take]))
                    continue
                del forced[:take]
                if take:
                    token_ids = token_ids[take:]
                    sample_logprobs = sample_logprobs[take:] if sample_logprobs is not None else None
                    text = self.tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""
                if not forced:
                    del self._forced[out.request_id]
                if not token_ids and not out.finished and not out.prompt_logprobs:
                    continue  # nothing new for kvmesh yet
            try:
                logprobs, prompt_logprobs = self._logprobs_of(out, sample_logprobs, token_ids)
            except (ValueError, TypeError, AttributeError) as exc:  # this request fails alone, never the engine thread
                logger.warning("request %s: vLLM's logprobs could not be read: %s", out.request_id, exc)
                outputs.append(self._failed(out.request_id, f"vLLM's logprobs could not be read: {exc}", ErrorCode.INTERNAL))
                continue
            export = None
            if out.finished:
                num_prompt = self._prompts.pop(out.request_id, num_prompt)
                self._untrack(out.request_id)
                handle = self._import_of.pop(out.request_id, None)
                if handle is not None:  # vLLM did not claim it (it had every block cached itself)
                    self._forget_import(handle)
                if out.request_id in self._exports:
                    self._exports.discard(out.request_id)
                    export = self._export_of(out.request_id, num_prompt, reason)
            outputs.append(
                RequestOutput(
                    request_id=out.request_id,
                    new_token_ids=token_ids,
                    text=text,
                    finished=bool(out.finished),
                    finish_reason=reason if out.finished else None,
                    num_prompt_tokens=num_prompt if forced is not None else len(out.prompt_token_ids or ()),
                    num_cached_tokens=int(out.num_cached_tokens or 0),
                    kv_export=export,
                    error="vLLM failed this request" if reason is FinishReason.ERROR else None,
                    error_code=ErrorCode.INTERNAL if reason is FinishReason.ERROR else None,  # vLLM's engine fault: retry elsewhere
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                )
            )  # fmt: skip
        self._fill_imports()
        self._drop_gone_releases()
        self._pending.extend(self.names.translate(self.events.take()))
        self.last_step_tokens = 1 if outputs or self.scheduler.has_unfinished_requests() else 0
        return outputs

    def abort_request(self, request_id: str) -> RequestOutput | None:
        prompt = self._prompts.pop(request_id, None)
        if prompt is None:
            return None
        self.engine.abort_request([request_id])
        self._exports.discard(request_id)
        self._untrack(request_id)
        handle = self._import_of.pop(request_id, None)
        if handle is not None:
            self._forget_import(handle)
        return RequestOutput(request_id, [], "", True, FinishReason.ABORT, prompt, 0)

    def _logprobs_of(
        self, out: Any, sample_logprobs: Any, token_ids: list[int]
    ) -> tuple[list[TokenLogprob | None] | None, list[TokenLogprob | None] | None]:
        """kvmesh's logprobs of an output's new tokens, and its prompt's (once: vLLM gives
        them with the output that finished the prompt), where the request asked for them."""
        sample_k, prompt_k = self._logprobs.get(out.request_id, (None, None))
        logprobs = logprobs_of(sample_logprobs, token_ids, sample_k) if sample_k is not None else None
        prompt_logprobs = None
        if prompt_k is not None and out.prompt_logprobs:  # an empty list on the outputs after that one
            prompt_logprobs = prompt_logprobs_of(out.prompt_logprobs, out.prompt_token_ids, prompt_k)
        return logprobs, prompt_logprobs

    def _fail_forced(self, request_id: str, wanted: list[int], got: list[int]) -> RequestOutput:
        """vLLM output other tokens than the forced ones (its grammar refused one): the
        request ends here with an error, never with output that left the grammar."""
        logger.warning("request %s: vLLM output %s where %s were forced", request_id, got, wanted)
        message = f"the tokens generated before {wanted} do not continue under the request's grammar on this vLLM worker"
        return self._failed(request_id, message, ErrorCode.REQUEST_FAILED)

    def _failed(self, request_id: str, message: str, code: ErrorCode) -> RequestOutput:
        """End a request of vLLM's here, with an error: vLLM aborts it (its blocks go back)."""
        prompt = self._prompts.get(request_id, 0)
        self._exports.discard(request_id)  # nobody will pull it
        self.abort_request(request_id)
        if self.exchange is not None:
            with self.exchange.lock:
                kept = request_id in self.exchange.exports  # it had finished: the connector kept its blocks
            if kept:
                self.release_export(request_id)
        return RequestOutput(request_id, [], "", True, FinishReason.ERROR, prompt, 0, error=message, error_code=code)

    # -- export (prefill workers) ----------------------------------------------------------
    def _export_of(self, request_id: str, num_tokens: int, reason: FinishReason | None) -> KVExport | None:
        exchange = self._connector()
        with exchange.lock:
            kept = exchange.exports.get(request_id)
        if kept is not None and reason in (FinishReason.ABORT, FinishReason.ERROR):
            self.release_export(request_id)  # kept although it failed: nobody else will release it
            return None
        if kept is None:
            return None
        blocks = kept[1][: -(-num_tokens // self.block_size)]
        layout = self.layout
        return KVExport(
            tuple(blocks), num_tokens,
            KVLayout(layout.num_blocks, layout.block_size, layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype),
        )  # fmt: skip

    def release_export(self, handle: str) -> bool:
        """vLLM may free the blocks it kept for ``handle`` (at its next step), or the
        cached blocks lent under ``handle`` (at once)."""
        lent = self._lent.pop(handle, None)
        if lent is not None:
            self.block_pool.free_blocks(reversed(lent))  # the chain's tail evicted first, as vLLM frees
            return True
        exchange = self._connector()
        with exchange.lock:
            kept = exchange.exports.pop(handle, None)
            if kept is not None:
                exchange.to_release.add(kept[0])
        return kept is not None

    def _drop_gone_releases(self) -> None:
        """Releases of requests vLLM no longer holds: nothing to free, and left pending they
        would keep the engine stepping (``has_unfinished``) with no request to step."""
        if self.exchange is None:
            return
        held = self.scheduler.requests
        with self.exchange.lock:
            gone = {r for r in self.exchange.to_release | self.exchange.finished_seen if r not in held}
            if gone:
                logger.warning("releases of %d requests vLLM no longer holds: dropped", len(gone))
                self.exchange.to_release -= gone
                self.exchange.finished_seen -= gone

    # -- import (decode workers) -----------------------------------------------------------
    def allocate_import(
        self, handle: str, num_tokens: int, params: SamplingParams | None = None, resumed: bool = False
    ) -> list[int] | None:
        """Blocks of vLLM's pool for a pull to fill, outside any request of vLLM's (its
        request gets blocks of its own when scheduled, and the pulled KV is copied there).
        ``params`` and ``resumed`` are not looked at: vLLM's scheduler keeps no room back for growth."""
        self._connector()
        if handle in self._staged or handle in self._importing or handle in self._prefixes:
            raise ValueError(f"handle {handle!r} is already in use")
        needed = -(-num_tokens // self.block_size)
        if self.block_pool.get_num_free_blocks() < 2 * needed + 1:  # the copy needs as many again
            return None
        blocks = self.block_pool.get_new_blocks(needed)
        self._staged[handle] = blocks
        return [b.block_id for b in blocks]

    def release_import(self, handle: str) -> bool:
        """Give back blocks of ``allocate_import`` no request took: pulled into or not, or
        holding a peer's prefix no prefill used."""
        blocks = self._staged.pop(handle, None)
        if blocks is None:
            prefix = self._prefixes.pop(handle, None)
            blocks = prefix.blocks if prefix is not None else None
        if blocks is None:
            return False
        self.block_pool.free_blocks(blocks)
        return True

    def add_imported_request(
        self, request_id: str, prompt_token_ids: list[int], first_token_id: int, handle: str, params: SamplingParams | None = None
    ) -> RequestOutput:
        """Decode from the KV pulled into the blocks of ``handle``: vLLM gets the prompt and
        the first token, and the connector has it take every prompt token from the import.
        A guided request's vLLM gets the prompt alone and outputs the first token again,
        forced (its grammar starts at its first output token): the connector has it take all
        but the prompt's last token. Returns the output for the first token."""
        params = params or SamplingParams()
        if request_id in self._prompts:
            raise ValueError(f"request id {request_id!r} is already in use")
        staged = self._staged.pop(handle, None)
        if staged is None:
            raise ValueError(f"no blocks were allocated for {handle!r}")
        self._this_thread()
        n = len(prompt_token_ids)
        text = self.tokenizer.decode([first_token_id], skip_special_tokens=True)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        may_stop = params.min_tokens <= params.prior_output_tokens + 1
        stop = may_stop and (first_token_id in params.stop_token_ids or (not params.ignore_eos and first_token_id == eos))
        if stop or params.max_tokens <= 1:
            self.block_pool.free_blocks(staged)
            reason = FinishReason.STOP if stop else FinishReason.LENGTH
            first_logprob: list[TokenLogprob | None] | None = [None] if params.logprobs is not None else None  # the prefill's
            return RequestOutput(request_id, [first_token_id], text, True, reason, n, n, logprobs=first_logprob)
        forced: list[int] = []
        if params.guided is None:  # vLLM computes the first token's position and samples the second
            prompt = [*prompt_token_ids, first_token_id]
            transfer = {IMPORT: handle, NUM_TOKENS: n}
        else:  # vLLM outputs the first token again, forced, under its grammar (``vllm_forced``)
            prompt, forced = self._split_forced(list(prompt_token_ids), params)
            forced.append(first_token_id)
            transfer = {IMPORT: handle, NUM_TOKENS: len(prompt) - 1}  # it computes the prompt's last position
        sampling = self.sampling(
            params, max_tokens=params.max_tokens - 1, generated=1, transfer=transfer, forced=forced, prompt_logprobs=False
        )
        self._importing[handle] = (staged, 0)
        try:
            vllm_id = self.engine.add_request(request_id, {"prompt_token_ids": prompt}, sampling)
        except BaseException:
            self._importing.pop(handle, None)
            self.block_pool.free_blocks(staged)
            raise
        self._adopt(vllm_id, staged, min(n, len(prompt)))
        self._track(request_id, params, forced)
        self._prompts[request_id] = n
        self._import_of[request_id] = handle
        first_logprob = [None] if params.logprobs is not None else None
        return RequestOutput(request_id, [first_token_id], text, False, None, n, n, logprobs=first_logprob)

    def _adopt(self, vllm_id: str, staged: list[Any], num_tokens: int, *, start: int = 0) -> None:
        """Name an import's whole blocks (``staged[i]`` holding the prompt's block
        ``start + i``; a borrowed prefix starts after vLLM's own cached blocks) in vLLM's
        prefix cache under its request's own block hashes: vLLM's scheduler finds them as
        prefix hits and uses them where the pull put them, and the connector loads only the
        part block after them (copied), if any. Our reference keeps them from eviction until
        the request has them."""
        request = self.scheduler.requests.get(vllm_id)
        if request is None or not self.block_pool.enable_caching:
            return  # the connector loads (copies) every block
        end = min(num_tokens // self.block_size, len(request.block_hashes), start + len(staged))
        if end > start:  # cache_full_blocks reads blocks[start:end] only
            self.block_pool.cache_full_blocks(request, [None] * start + staged, start, end, self.block_size, 0)

    def _fill_imports(self) -> None:
        """Copy each import's pulled KV into the blocks vLLM allocated for its request, then
        let vLLM go on with it (the connector reports it received)."""
        if self.exchange is None:
            return
        with self.exchange.lock:
            ready = list(self.exchange.imports.items())
            self.exchange.imports.clear()
        if not ready:
            return
        for vllm_id, imp in ready:
            entry = self._importing.pop(imp.handle, None)
            if entry is None:  # aborted meanwhile: vLLM frees its blocks once they are reported received
                with self.exchange.lock:
                    self.exchange.loaded.add(vllm_id)
                continue
            staged, start = entry  # staged[i] holds the prompt's block start + i
            self._import_of = {r: h for r, h in self._import_of.items() if h != imp.handle}
            first, last = max(imp.first_block, start), min(start + len(staged), len(imp.block_ids))
            if first < last:
                src = [b.block_id for b in staged[first - start : last - start]]
                copy_blocks(self.kv_caches, src, imp.block_ids[first:last])
                self.blocks_copied += last - first
            self.block_pool.free_blocks(staged)
            with self.exchange.lock:
                self.exchange.loaded.add(vllm_id)

    def _forget_import(self, handle: str) -> None:
        entry = self._importing.pop(handle, None)
        if entry is not None:
            self.block_pool.free_blocks(entry[0])

    def _connector(self) -> Exchange:
        if self.exchange is None:
            raise UnsupportedByVllm("this vLLM engine runs without the kvmesh KV connector")
        return self.exchange

    # -- cached blocks shared with peers ------------------------------------------------
    def cached_prefix_length(self, block_hashes: list[int]) -> int:
        return len(self._leading_cached(block_hashes))

    def _leading_cached(self, block_hashes: list[int]) -> list[Any]:
        """vLLM's cached blocks of the chain's leading blocks (to the first it lacks)."""
        blocks: list[Any] = []
        for name in block_hashes:
            vllm_hash = self.names.vllm_hash(name)
            if not isinstance(vllm_hash, bytes):  # unknown (or vLLM's int event hashes: no lookup)
                break
            found = self.block_pool.get_cached_block(vllm_hash, [0])  # one KV cache group
            if not found:
                break
            blocks.append(found[0])
        return blocks

    def lend_cached_blocks(self, handle: str, block_hashes: list[int]) -> list[int]:
        """Reference the leading cached blocks of the chain in vLLM's block pool under
        ``handle``: while referenced, vLLM neither evicts nor reuses them (and never writes a
        full cached block), so a peer may read them in place; ``release_export`` lets go."""
        if handle in self._lent:
            raise ValueError(f"blocks are already lent under {handle!r}")
        blocks = self._leading_cached(block_hashes)
        self.block_pool.touch(blocks)
        self._lent[handle] = blocks
        return [b.block_id for b in blocks]

    def cache_imported_blocks(self, handle: str, block_hashes: list[int], parent_hash: int | None) -> None:
        """The blocks of ``allocate_import(handle, ...)`` now hold these blocks' KV (a prefix
        pulled from a peer): the next request whose prompt has this chain (the prefill that
        pulled it) takes them through the connector, and vLLM caches them under its own
        hashes as it does every block; ``release_import`` frees them if none does."""
        blocks = self._staged.get(handle)
        if blocks is None:
            raise ValueError(f"no blocks were allocated for {handle!r}")
        if len(blocks) != len(block_hashes) or not block_hashes:
            raise ValueError(f"{len(blocks)} blocks allocated for {len(block_hashes)} hashes")
        del self._staged[handle]
        self._prefixes[handle] = PrefixImport(blocks, list(block_hashes))

    def _take_prefix(self, prompt_token_ids: list[int]) -> tuple[str, int, int] | None:
        """A prefix import this prompt can use: (handle, its first prompt block, the block
        after its last). Only blocks before the prompt's last token (vLLM computes that one)."""
        if not self._prefixes:
            return None
        hashes = hash_token_blocks(prompt_token_ids[:-1], self.block_size, (self.model_name,))
        where = {h: i for i, h in enumerate(hashes)}  # chained: a hash names its whole prefix
        for handle, prefix in self._prefixes.items():
            first = where.get(prefix.hashes[0])
            if first is not None and hashes[first : first + len(prefix.hashes)] == prefix.hashes:
                del self._prefixes[handle]
                self._importing[handle] = (prefix.blocks, first)
                return handle, first, first + len(prefix.hashes)
        return None

    # -- reporting -----------------------------------------------------------------------
    def take_kv_events(self) -> list[KVCacheEvent]:
        self._pending.extend(self.names.translate(self.events.take()))
        events, self._pending = self._pending, []
        return events

    def has_kv_events(self) -> bool:
        """vLLM's events are known only once taken on the engine's thread: always ask."""
        return True

    def kv_snapshot(self) -> tuple[list[KVCacheEvent], list[int]]:
        events = self.take_kv_events()
        return events, self.names.cached()

    def pool_stats(self) -> PoolStats:
        total = self.block_pool.num_gpu_blocks - 1  # block 0 is vLLM's null block, never handed out
        free = self.block_pool.get_num_free_blocks()
        return PoolStats(
            num_blocks=total, num_free=free, num_cached=len(self.names.cached()), num_in_use=total - free,
            num_held=self._num_held(), block_size=self.block_size,
        )  # fmt: skip

    def _num_held(self) -> int:
        """Blocks held outside vLLM's requests: lent, taken for imports, kept for exports."""
        held = sum(map(len, self._lent.values())) + sum(map(len, self._staged.values()))
        held += sum(len(p.blocks) for p in self._prefixes.values()) + sum(len(b) for b, _ in self._importing.values())
        if self.exchange is not None:
            with self.exchange.lock:
                held += sum(len(blocks) for _, blocks in self.exchange.exports.values())
        return held

    @property
    def num_preemptions(self) -> int:
        """vLLM's preemptions so far (``vllm_stats``), as ``AsyncEngine`` reads kvmesh's engine's."""
        return self.stats.num_preemptions

    def load(self) -> dict[str, int]:
        running, waiting = self.scheduler.get_request_counts()  # waiting: those holding KV too (imports)
        return {"running": running, "waiting": waiting, "free_blocks": self.block_pool.get_num_free_blocks()}

    def _this_thread(self) -> None:
        """OpenMP threads are per calling thread: the engine thread gets the worker's count."""
        ident = threading.get_ident()
        if self._thread_set == ident or not self._num_threads:
            return
        import torch

        torch._C.set_num_threads(self._num_threads)  # vLLM's CPU worker makes torch.set_num_threads a no-op
        self._thread_set = ident
