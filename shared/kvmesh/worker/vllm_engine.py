"""vLLM as a worker's ``Engine`` (``--engine vllm``), imported only when a worker hosts it.

vLLM's ``LLMEngine`` runs in the worker's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
its engine core and model runner here, not in a child), stepped on the thread of
``kvmesh.engine.async_engine.AsyncEngine`` like kvmesh's own engine, so that its KV pool is
this process's memory: read from the model runner's tensors as a ``PoolLayout``, registered
with the transfer engine and published like any pool. The worker's settings become
``EngineArgs``: the model folder kvmesh's loader converts, dtype, block size, max model len,
KV cache bytes, batch limits, prefix caching, then ``--engine-args`` (JSON) last. The
process is bound to its cores (``--cpu-bind``) before vLLM loads, and the engine thread
runs ``num_threads`` OpenMP threads there; with ``--lend-cores`` (``kvmesh.engine.core_lending``)
it may run on every core, each step on the threads the board allows then, the count changed
only between steps: vLLM's CPU attention fixes it in a step's metadata, so a borrowed step
cannot give cores back between layers as kvmesh's engine does.

With tensor parallel (``--tensor-parallel-size``) the engine core stays here and vLLM's
ranks are processes of its own, each bound to its share of the cores and holding its share
of the pool (its heads): each rank moves its pool onto memory this process maps too
(``kvmesh.worker.shared_pool``), rank after rank, so that the pool is published as one
layout of ``ranks`` (registered with the transfer engine, pulled from and into rank by rank)
and imports are copied here as for one process.

Prefill for export and decode from imported KV go through kvmesh's KV connector
(``kvmesh.worker.vllm_connector``, vLLM's connector V1 API) in this process, and so does a
prefix pulled from a peer; cached blocks are lent to peers by holding a reference to them in
vLLM's block pool (``VllmCore.lend_cached_blocks``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any, cast

from kvmesh.engine.async_engine import AsyncEngine, StepObserver
from kvmesh.engine.core_lending import CoreLending, parse_lending
from kvmesh.engine.own_thread import run_in_own_thread
from kvmesh.engine.loader.default_model import resolve_model, served_model_name
from kvmesh.hashing import hash_token_blocks
from kvmesh.transfer.layout import ITEMSIZE, PoolLayout
from kvmesh.errors import EngineConfigError
from kvmesh.worker.kv_tensors import pool_layout_of
from kvmesh.worker.shared_pool import RankPool, map_rank_pools, share_rank_pool
from kvmesh.worker.engine_api import Engine
from kvmesh.settings.worker import EngineSettings
from kvmesh.worker.engines import tensor_parallel
from kvmesh.worker.vllm_core import VllmCore
from kvmesh.worker.vllm_exchange import EXCHANGES, new_exchange
from kvmesh.worker.vllm_outputs import GUIDANCE
from kvmesh.worker.vllm_stats import VllmStats

FORCED_TOKENS = "kvmesh.worker.vllm_forced:ForcedTokens"  # a vLLM logits processor, by its FQCN

logger = logging.getLogger(__name__)


class VllmEngine(AsyncEngine):
    """vLLM in this process as an ``Engine``."""

    def __init__(
        self, core: VllmCore, layout: PoolLayout, max_model_len: int, vocab_size: int, lending: CoreLending | None = None
    ) -> None:
        super().__init__(cast(Any, core), lending)  # the face AsyncEngine drives (add, step, abort, load)
        self.core = core
        self._layout = layout
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size

    @classmethod
    async def start(cls, s: EngineSettings) -> VllmEngine:
        """The engine a worker's settings describe, loaded off the event loop on a thread
        that ends with the loading (``kvmesh.engine.own_thread`` says why)."""
        return await run_in_own_thread(lambda: cls.build(s), "vllm-engine-load")

    @classmethod
    def build(cls, s: EngineSettings) -> VllmEngine:
        ranks = tensor_parallel(s.tensor_parallel_size, s.engine_args)
        cores = bind_cores(s.cpu_bind, None if s.lend_cores else s.num_threads)  # lending: every core, each step its threads
        lending = parse_lending(s.lend_cores, s.num_threads) if s.lend_cores else None
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core (and, one rank, the KV pool) in this process
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # its internal traffic on loopback
        # KV events with vLLM's own block hashes (bytes), not 64-bit ints made of them: a lend
        # looks the blocks up by them in vLLM's prefix cache
        os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = rank_cores(cores, ranks)
        from vllm import EngineArgs  # type: ignore[import-not-found]
        from vllm.v1.engine.llm_engine import LLMEngine as VllmLLMEngine  # type: ignore[import-not-found]

        model_dir = resolve_model(s.model)
        name = s.served_model_name or served_model_name(s.model, model_dir)
        exchange = new_exchange()  # what the kvmesh KV connector vLLM loads shares with VllmCore
        args = engine_args(s, model_dir, name, exchange)
        logger.info("vLLM engine args: %s", ", ".join(f"{k}={v}" for k, v in args.items()))
        engine_args_ = EngineArgs(**args)
        if engine_args_.pipeline_parallel_size > 1:  # settings refuse it first (``parallel_problem``)
            raise ValueError("--engine vllm: pipeline parallel is not run by kvmesh's workers yet")
        stats = VllmStats()  # preemptions and request phases from vLLM's own stats
        engine = VllmLLMEngine.from_engine_args(engine_args_, stat_loggers=[stats.stat_logger_class()])
        stats.keep_only_ours(engine)
        block_size = engine.vllm_config.cache_config.block_size
        if ranks > 1:
            layout, caches = shared_pool_layout(engine, s.dtype, block_size)
        else:
            layout, caches = pool_layout(engine, s.dtype, block_size), None
        core = VllmCore(engine, name, layout, None if lending else len(cores), EXCHANGES[exchange], kv_caches=caches)
        core.stats = stats
        if layout.ranks > 1:
            logger.info(
                "vLLM KV pool: %d blocks of %d tokens in each of %d worker processes (tensor parallel), mapped here %d bytes apart from %#x",
                layout.num_blocks, block_size, layout.ranks, layout.rank_stride, layout.base_address,
            )  # fmt: skip
        else:
            logger.info("vLLM KV pool: %d blocks of %d tokens, %d bytes at %#x", layout.num_blocks, block_size, layout.pool_bytes, layout.base_address)
        if lending is not None:
            logger.info("cores lent: %d thread(s) of its own, %d while the other engines are idle", lending.own, lending.most)
        return cls(core, layout, engine.model_config.max_model_len, engine.model_config.get_vocab_size(), lending)

    def observe_steps(self, observer: StepObserver) -> None:
        super().observe_steps(observer)
        self.core.stats.observe(observer)  # queue / prefill / decode times as vLLM timed them

    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def kv_layout(self) -> PoolLayout:
        return self._layout

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        return hash_token_blocks(token_ids, self._layout.block_size, (self.core.model_name,))

    async def shutdown(self) -> None:
        await super().shutdown()
        await asyncio.to_thread(self.core.engine.engine_core.shutdown)


def bind_cores(cpu_bind: str | None, num_threads: int | None) -> list[int]:
    """Bind this process (every thread it has, and so every thread it makes) to the cores
    ``cpu_bind`` names (``"0"``, ``"0,1"``, ``"0-3"``), or to the first ``num_threads`` of
    those it may use; returns them."""
    allowed = sorted(os.sched_getaffinity(0))
    cores = parse_cores(cpu_bind) if cpu_bind else allowed[: num_threads or len(allowed)]
    if not cores or not set(cores) <= set(allowed):
        raise ValueError(f"--cpu-bind {cpu_bind}: cores {cores} are not among this process's {allowed}")
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except OSError:  # a thread that has just ended
            pass
    os.environ["OMP_NUM_THREADS"] = str(len(cores))
    return cores


def rank_cores(cores: list[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``ranks`` worker processes on ``cores``: each its own
    share, the first ones a core more where they do not divide (``"0,1|2"``), or, fewer cores
    than ranks, one core each, shared round the cores (``"0|1|0"``)."""
    if len(cores) < ranks:
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    share, extra = divmod(len(cores), ranks)
    bounds = [r * share + min(r, extra) for r in range(ranks + 1)]
    return "|".join(",".join(map(str, cores[bounds[r] : bounds[r + 1]])) for r in range(ranks))


def parse_cores(text: str) -> list[int]:
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return sorted(set(cores))


def engine_args(s: EngineSettings, model_dir: Path, name: str, exchange: str | None) -> dict[str, Any]:
    """vLLM's ``EngineArgs`` from a worker's settings, with kvmesh's KV connector sharing
    ``exchange`` (None: no connector, for a benchmark's engine); ``--engine-args`` last, so it wins."""
    args: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": name,
        "dtype": s.dtype,
        "block_size": s.block_size,
        "max_model_len": s.max_model_len or default_max_model_len(model_dir, s.dtype, s.block_size, s.kv_cache_bytes),
        "kv_cache_memory_bytes": s.kv_cache_bytes,
        "enable_prefix_caching": s.enable_prefix_caching,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "enforce_eager": True,  # no torch.compile: minutes of start-up on a small CPU
        "disable_log_stats": False,  # vLLM's stats feed the worker's metrics (``vllm_stats``)
        "seed": 0,
        "tensor_parallel_size": s.tensor_parallel_size,
        # KV events into this process (``VllmCore`` replaces the null publisher with its queue)
        "kv_events_config": {"enable_kv_cache_events": True, "publisher": "null"},
        # structured output with llguidance, as kvmesh's engine; a guided import's first token
        # output again, forced (``kvmesh.worker.vllm_forced``, ``vllm_outputs``)
        "structured_outputs_config": {"backend": GUIDANCE},
        "logits_processors": [FORCED_TOKENS],
    }
    if exchange is not None:  # prefill for export and decode from imports (``kvmesh.worker.vllm_connector``)
        args["kv_transfer_config"] = {
            "kv_connector": "KvmeshConnector",
            "kv_connector_module_path": "kvmesh.worker.vllm_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvmesh_exchange": exchange},
        }
    if s.engine_args:
        args.update(json.loads(s.engine_args))
    if isinstance(args["kv_events_config"], dict):
        from vllm.config import KVEventsConfig  # type: ignore[import-not-found]

        args["kv_events_config"] = KVEventsConfig(**args["kv_events_config"])
    if isinstance(args.get("structured_outputs_config"), dict):
        from vllm.config import StructuredOutputsConfig  # type: ignore[import-not-found]

        args["structured_outputs_config"] = StructuredOutputsConfig(**args["structured_outputs_config"])
    return args


def default_max_model_len(model_dir: Path, dtype: str, block_size: int, kv_cache_bytes: int) -> int:
    """The model's context, or less where the KV pool cannot hold one whole sequence (vLLM
    refuses to start then)."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    token_bytes = 2 * config["num_hidden_layers"] * heads * head_dim * ITEMSIZE.get(dtype, 4)
    blocks = kv_cache_bytes // (token_bytes * block_size)
    fits = (blocks - 1) * block_size  # block 0 is vLLM's null block
    if fits < block_size:
        raise EngineConfigError(f"a KV cache of {kv_cache_bytes} bytes holds no {block_size}-token block of this model")
    return min(int(config.get("max_position_embeddings", fits)), fits)


def pool_layout(engine: Any, dtype: str, block_size: int) -> PoolLayout:
    """The pool from the model runner's KV tensors (vLLM's one worker, in this process), read
    as they are (``kvmesh.worker.kv_tensors``): on CPU one tensor per layer ``[blocks,
    kv_heads, tokens, 2 * head_dim]``, all views of one storage."""
    [layout] = engine.model_executor.collective_rpc(rank_pool_layout, args=(dtype, block_size))
    return cast(PoolLayout, layout)


def rank_pool_layout(worker: Any, dtype: str, block_size: int) -> PoolLayout:
    """Run by each of vLLM's workers (``collective_rpc``): its pool, from its model runner."""
    return pool_layout_of(list(worker.worker.model_runner.kv_caches), dtype=dtype, block_size=block_size)


def shared_pool_layout(engine: Any, dtype: str, block_size: int) -> tuple[PoolLayout, list[Any]]:
    """A tensor-parallel pool: each rank's moved onto shared memory and mapped here, rank
    after rank (``kvmesh.worker.shared_pool``); its layout (rank 0's, read from the tensors
    here, with where the others lie) and every rank's layer tensors here, for copies."""
    mapped = map_rank_pools(engine.model_executor.collective_rpc(rank_share_pool))
    layouts = [pool_layout_of(caches, dtype=dtype, block_size=block_size) for caches in mapped.caches]
    first = layouts[0]
    for rank, layout in enumerate(layouts):
        if dataclasses.replace(layout, base_address=first.base_address) != first or layout.base_address != first.base_address + rank * mapped.stride:
            raise EngineConfigError(f"vLLM's tensor-parallel rank {rank} lays its KV pool out unlike rank 0")
    layout = dataclasses.replace(first, ranks=len(layouts), rank_stride=mapped.stride)
    return layout, [t for caches in mapped.caches for t in caches]


def rank_share_pool(worker: Any) -> RankPool:
    """Run by each of vLLM's tensor-parallel workers (``collective_rpc``) before any request:
    its pool moved onto memory the worker's process maps, under the model runner's tensors
    and the attention layers' views of them alike."""
    import torch

    runner = worker.worker.model_runner
    bound: list[Any] = []
    for layer in runner.compilation_config.static_forward_context.values():
        cache = getattr(layer, "kv_cache", None)
        bound.extend(t for t in (cache if isinstance(cache, (list, tuple)) else [cache]) if isinstance(t, torch.Tensor))
    return share_rank_pool(list(runner.kv_caches), also=bound)


def _is_an_engine(engine: VllmEngine) -> Engine:
    return engine  # mypy checks here that VllmEngine implements the interface
