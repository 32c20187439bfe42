"""The synchronous engine: requests in, one scheduled model step at a time, outputs out.

It is not thread-safe; ``AsyncEngine`` runs it on a thread of its own. It knows nothing of
NATS, etcd or HTTP.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmesh.engine.block_pool import BlockPool, KVCacheEvent
from kvmesh.engine.detokenizer import OutputText
from kvmesh.engine.device import resolve_device
from kvmesh.engine.kv_cache import DTYPES, KVCachePool, KVLayout, num_blocks_for_budget
from kvmesh.engine.kv_cache_manager import KVCacheManager, PoolStats
from kvmesh.engine.loader.default_model import resolve_model, served_model_name
from kvmesh.engine.model.config import ModelConfig
from kvmesh.engine.model.llama import LlamaModel
from kvmesh.engine.model.weights import load_weights
from kvmesh.engine.model_runner import ModelRunner
from kvmesh.engine.outputs import KVExport, RequestOutput
from kvmesh.engine.request import FinishReason, Request, SamplingParams
from kvmesh.engine.scheduler import Scheduler, SchedulerConfig, max_model_len
from kvmesh.engine.structured import GrammarCompiler, GrammarError
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import EngineConfigError, ErrorCode
from kvmesh.machine import default_dtype
from kvmesh.hashing import hash_token_blocks

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None or the default name, a model directory, or a .gguf file
    served_model_name: str | None = None  # also keys the block hashes; defaults to the dir name
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_bytes: int = 512 * 2**20
    num_blocks: int | None = None  # overrides kv_cache_bytes
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    reserve_growth: bool = True  # admission keeps KV blocks back for running requests' growth (engine/admission.py)
    num_threads: int | None = None
    prepack_weights: bool = True  # oneDNN-prepacked linear weights on CPU (see model/linear.py)
    max_failed_steps: int = 3  # this many failed steps in a row and the engine gives up
    warm_grammar: bool = True  # build llguidance's tokenizer in the background at start, not on the first guided request

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES and self.dtype != "auto":
            raise EngineConfigError(f"dtype must be one of {sorted(DTYPES)} or auto, got {self.dtype!r}")
        if min(self.block_size, self.max_num_seqs, self.max_num_batched_tokens, self.max_failed_steps) < 1:
            raise EngineConfigError("block_size, max_num_seqs, max_num_batched_tokens and max_failed_steps must be positive")


def _output_text(tokenizer: Tokenizer, params: SamplingParams) -> OutputText:
    """Stop strings count once min_tokens tokens were generated, by earlier attempts too."""
    return OutputText(tokenizer, params.stop, max(0, params.min_tokens - params.prior_output_tokens))


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        logger.info(
            "torch threads: %d (%s)",
            torch.get_num_threads(),
            "--num-threads" if config.num_threads else "torch's default: the physical cores this process may use",
        )
        started = time.monotonic()
        self.model_dir: Path = resolve_model(config.model)
        self.model_name = config.served_model_name or served_model_name(config.model, self.model_dir)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.eos_token_ids = tuple(dict.fromkeys((*self.tokenizer.eos_token_ids, *self.model_config.eos_token_ids)))
        self.device = resolve_device(config.device)
        if config.dtype == "auto":
            config.dtype, why = default_dtype(str(self.device))
            logger.info("dtype auto: %s, since %s", config.dtype, why)
        dtype = DTYPES[config.dtype]
        weights = load_weights(self.model_dir, self.model_config, dtype, self.device)
        self.model = LlamaModel(self.model_config, weights, dtype, self.device, prepack=config.prepack_weights)
        del weights

        mc = self.model_config
        layout = KVLayout(1, config.block_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, config.dtype)
        num_blocks = config.num_blocks or num_blocks_for_budget(config.kv_cache_bytes, layout.block_bytes)
        self.kv_layout = KVLayout(num_blocks, config.block_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, config.dtype)
        self.kv_pool = KVCachePool(self.kv_layout, self.device)
        block_pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching, block_size=config.block_size)
        self.kv_manager = KVCacheManager(
            block_pool, extra_keys=(self.model_name,), enable_prefix_caching=config.enable_prefix_caching
        )
        self.max_model_len = max_model_len(mc.max_position_embeddings, num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.kv_manager,
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len, config.reserve_growth),
        )
        self.runner = ModelRunner(self.model, self.kv_pool, self.kv_manager)
        self._texts: dict[str, OutputText] = {}
        # structured output: llguidance's tokenizer is built off this thread now, not on the first guided request's step
        self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        if config.warm_grammar:
            self._grammars.warm()
        self._failed_steps = 0  # steps in a row whose batch raised
        self.last_step_tokens = 0  # tokens the last step scheduled; 0: no room for anything
        self.num_preemptions = 0  # requests preempted (recomputed later) since the start
        logger.info(
            "engine ready in %.1fs: model %s (%s, %d layers) on %s in %s, %d KV blocks of %d tokens",
            time.monotonic() - started,
            self.model_name,
            mc.model_type,
            mc.num_layers,
            self.device,
            config.dtype,
            num_blocks,
            config.block_size,
        )

    # -- requests ------------------------------------------------------------------------
    def _new_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, export_kv: bool
    ) -> Request:
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must lie in [0, {vocab})")
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, export_kv=export_kv)
        if params.guided is not None:  # structured output: the request's grammar matcher
            req.grammar = self._grammars.state(params.guided)
        return req

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        export_kv: bool = False,
        first: bool = False,
    ) -> Request:
        """Queue a request (``first``: ahead of those waiting). With ``export_kv`` it stops
        after its first token and its blocks stay held (see ``release_export``) for another
        worker to pull."""
        req = self._new_request(request_id, prompt_token_ids, params or SamplingParams(), export_kv)
        self.scheduler.add_request(req, first=first)
        self._texts[request_id] = _output_text(self.tokenizer, req.sampling)
        return req

    def add_imported_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        handle: str,
        params: SamplingParams | None = None,
    ) -> RequestOutput:
        """Start decoding a request whose prompt KV was written into the blocks held under
        ``handle`` (see ``allocate_import``); ``first_token_id`` came with the KV. Returns
        the output for that first token."""
        req = self._new_request(request_id, prompt_token_ids, params or SamplingParams(), False)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(prompt_token_ids) + 1 >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the limit is {self.max_model_len - 2}")
        self.kv_manager.attach_held(handle, req, len(prompt_token_ids))
        req.num_cached_tokens = len(prompt_token_ids)
        req.token_ids.append(first_token_id)
        if req.sampling.logprobs is not None:
            req.logprobs.append(None)  # computed where the prompt was
        req.prompt_logprobs_sent = True  # so were those
        self.scheduler.add_running(req)
        self._texts[request_id] = _output_text(self.tokenizer, req.sampling)
        reason = self.scheduler.token_stop_reason(req, first_token_id)
        if reason is not None:
            self.scheduler.finish(req, reason)
        return self._output_or_error(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        return self._output_or_error(req, new_tokens=0)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One model step. A request whose sampling or output fails ends with
        ``FinishReason.ERROR`` and the others go on; when the whole batch fails (inputs,
        forward, logits) each of its requests does, and after ``max_failed_steps`` such
        steps in a row the error is raised: the engine cannot go on."""
        out = self.scheduler.schedule()
        self.last_step_tokens = out.num_tokens
        self.num_preemptions += len(out.preempted)
        if not out.scheduled:
            return []
        try:
            sampled = self.runner.execute(out)
        except Exception as exc:
            self._failed_steps += 1
            logger.exception("step failed (%d in a row) for %d requests", self._failed_steps, len(out.scheduled))
            failed = [
                self._fail(item.request, exc, "step", kv_written=False, code=ErrorCode.INTERNAL) for item in out.scheduled
            ]
            if self._failed_steps >= self.config.max_failed_steps:
                raise
            return failed
        self._failed_steps = 0
        outputs: list[RequestOutput] = []
        tokens: list[int] = []
        kept = []
        values = iter(sampled)
        for item in out.scheduled:
            value = next(values) if item.samples else None
            if isinstance(value, Exception):
                logger.error("request %s: sampling failed", item.request.request_id, exc_info=value)
                outputs.append(self._fail(item.request, value, "sampling"))
                continue
            if value is not None:
                tokens.append(value)
            kept.append(item)
        out.scheduled = kept
        advanced = self.scheduler.update_from_output(out, tokens)
        outputs.extend(self._output_or_error(req) for req in advanced)
        return outputs

    def _output_or_error(self, req: Request, new_tokens: int = 1) -> RequestOutput:
        try:
            return self._output(req, new_tokens)
        except Exception as exc:
            logger.exception("request %s: building its output failed", req.request_id)
            return self._fail(req, exc, "detokenizing")

    def _fail(
        self, req: Request, exc: Exception, stage: str, *, kv_written: bool = True, code: ErrorCode = ErrorCode.REQUEST_FAILED
    ) -> RequestOutput:
        """End ``req`` with ``FinishReason.ERROR``; its blocks go back (see ``Scheduler.fail``)."""
        if isinstance(exc, GrammarError):  # the request's grammar (too complex, or tokens it refuses): its own fault
            code = ErrorCode.BAD_REQUEST
        self.scheduler.fail(req, kv_written=kv_written)
        self._texts.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[],
            text="",
            finished=True,
            finish_reason=FinishReason.ERROR,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            error=f"{stage} failed: {type(exc).__name__}: {exc}",
            error_code=code,
        )

    def _output(self, req: Request, new_tokens: int = 1) -> RequestOutput:
        text_state = self._texts[req.request_id]
        new_ids = req.token_ids[-new_tokens:] if new_tokens else []
        for token in new_ids:
            if text_state.add_token(token) and not req.is_finished:
                self.scheduler.finish(req, FinishReason.STOP)
        finished = req.is_finished
        export = None
        if finished:
            del self._texts[req.request_id]
            if req.export_kv and req.request_id in self.kv_manager.held:
                export = KVExport(
                    tuple(b.block_id for b in self.kv_manager.held[req.request_id]),
                    req.num_prompt_tokens,
                    self.kv_layout,
                )
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=list(new_ids),
            text=text_state.take_delta(finished),
            finished=finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            kv_export=export,
            queue_seconds=self._queue_seconds(req),
            logprobs=req.logprobs[len(req.logprobs) - len(new_ids) :] if req.sampling.logprobs is not None else None,
            prompt_logprobs=self._take_prompt_logprobs(req),
        )

    @staticmethod
    def _take_prompt_logprobs(req: Request) -> list | None:
        """A request's prompt logprobs, once: on its first output after the prompt."""
        if req.sampling.prompt_logprobs is None or req.prompt_logprobs_sent or req.num_computed_tokens < req.num_prompt_tokens:
            return None
        req.prompt_logprobs_sent = True
        logprobs, req.prompt_logprobs = req.prompt_logprobs, []
        return logprobs

    def _queue_seconds(self, req: Request) -> float | None:
        if req.first_scheduled_time is None or req.num_output_tokens > 1:
            return None
        return req.first_scheduled_time - req.arrival_time

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion; one combined output per prompt, in order."""
        per_prompt = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        results = {
            rid: RequestOutput(rid, [], "", False, None, len(p), 0) for rid, p in zip(ids, prompts)
        }
        for rid, prompt, sp in zip(ids, prompts, per_prompt):
            self.add_request(rid, prompt, sp)
        while self.has_unfinished():
            for out in self.step():
                merged = results[out.request_id]
                merged.new_token_ids.extend(out.new_token_ids)
                merged.text += out.text
                merged.finished, merged.finish_reason, merged.error = out.finished, out.finish_reason, out.error
                merged.num_cached_tokens = out.num_cached_tokens
                if out.logprobs is not None:
                    merged.logprobs = (merged.logprobs or []) + out.logprobs
                if out.prompt_logprobs is not None:
                    merged.prompt_logprobs = out.prompt_logprobs
        return [results[rid] for rid in ids]

    # -- disaggregation ------------------------------------------------------------------
    def release_export(self, request_id: str) -> bool:
        """Free the blocks a finished export held (after the peer pulled them)."""
        return self.kv_manager.release_held(request_id)

    def allocate_import(
        self, handle: str, num_tokens: int, params: SamplingParams | None = None, resumed: bool = False
    ) -> list[int] | None:
        """Blocks to receive the KV of ``num_tokens`` tokens from a peer; ``None`` if no room.
        With ``params`` (of a request to decode from that KV, ``add_imported_request``) only
        where admission takes that request now, unless it is ``resumed`` mid-answer
        (``Scheduler.take_import``)."""
        return self.scheduler.take_import(handle, num_tokens, None if params is None else params.max_tokens, resumed=resumed)

    def release_import(self, handle: str) -> bool:
        return self.kv_manager.release_held(handle)

    # -- cross-worker prefix reuse -------------------------------------------------------
    def block_hashes(self, token_ids: list[int]) -> list[int]:
        """The chained hashes of the full blocks of ``token_ids``, as this engine names them."""
        return hash_token_blocks(token_ids, self.kv_layout.block_size, (self.model_name,))

    def cached_prefix_length(self, block_hashes: list[int]) -> int:
        return self.kv_manager.cached_prefix_length(block_hashes)

    def lend_cached_blocks(self, handle: str, block_hashes: list[int]) -> list[int]:
        """Hold the leading cached blocks of a chain for a peer to read (``release_import``)."""
        return self.kv_manager.hold_cached(handle, block_hashes)

    def cache_imported_blocks(self, handle: str, block_hashes: list[int], parent_hash: int | None) -> None:
        """The blocks of ``allocate_import(handle, ...)`` now hold these blocks' KV: cache them."""
        self.kv_manager.cache_held(handle, block_hashes, parent_hash)

    # -- reporting -----------------------------------------------------------------------
    def take_kv_events(self) -> list[KVCacheEvent]:
        return self.kv_manager.take_events()

    def has_kv_events(self) -> bool:
        """Are KV events waiting (``take_kv_events``)? Safe to ask off the engine's thread."""
        return self.kv_manager.pool.has_events()

    def kv_snapshot(self) -> tuple[list[KVCacheEvent], list[int]]:
        """Pending events and every cached block hash, taken together: the hashes are the
        state after those events."""
        return self.kv_manager.take_events(), list(self.kv_manager.pool.cached)

    def pool_stats(self) -> PoolStats:
        return self.kv_manager.stats()

    def load(self) -> dict[str, int]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "free_blocks": self.kv_manager.pool.num_free_blocks,
            "reserved_blocks": self.scheduler.reserved_blocks,
        }
