"""kvmesh's own PyTorch engine (``kvmesh.engine``) as an ``Engine``: ``AsyncEngine`` with the
few facts the interface adds (the served model, the pool's layout read from its tensor).
The one module of the worker that knows that engine's insides."""

from __future__ import annotations

from dataclasses import fields

from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.core_lending import CoreLending, parse_lending
from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.own_thread import run_in_own_thread
from kvmesh.transfer.layout import KVMESH_ARRANGEMENT, PoolLayout
from kvmesh.worker.engine_api import Engine
from kvmesh.settings.worker import EngineSettings


class KvmeshEngine(AsyncEngine):
    """kvmesh's own engine as an ``Engine``."""

    def __init__(self, engine: LLMEngine, lending: CoreLending | None = None) -> None:
        super().__init__(engine, lending)
        self._layout = pool_layout(engine)

    @classmethod
    async def create(cls, config: EngineConfig | None = None, lending: CoreLending | None = None) -> KvmeshEngine:
        """Load the model off the event loop (on a thread that ends with the loading:
        ``kvmesh.engine.own_thread`` says why), then start the engine thread."""
        return cls(await run_in_own_thread(lambda: LLMEngine(config), "kvmesh-engine-load"), lending)

    @classmethod
    async def start(cls, s: EngineSettings) -> KvmeshEngine:
        """The engine a worker's settings describe: each field of ``EngineConfig`` the
        settings have (the vLLM-only ones are not its), on the threads its lending board
        allows where it has one (``--lend-cores``)."""
        config = EngineConfig(**{f.name: getattr(s, f.name) for f in fields(EngineConfig) if hasattr(s, f.name)})
        return await cls.create(config, parse_lending(s.lend_cores, s.num_threads) if s.lend_cores else None)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def kv_layout(self) -> PoolLayout:
        return self._layout

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        return self.engine.block_hashes(token_ids)


def pool_layout(engine: LLMEngine) -> PoolLayout:
    """The layout of kvmesh's pool, from its tensor ``[blocks, layers, 2, tokens, heads, dim]``."""
    pool, layout = engine.kv_pool, engine.kv_layout
    tensor = pool.tensor
    assert tensor.is_contiguous() and tuple(tensor.shape) == layout.shape
    itemsize = tensor.element_size()
    return PoolLayout(
        engine="kvmesh",
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_blocks=layout.num_blocks,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        layer_stride=tensor.stride(1) * itemsize,
        block_stride=tensor.stride(0) * itemsize,
        arrangement=KVMESH_ARRANGEMENT,
        base_address=pool.base_address,
        pool_bytes=pool.nbytes,
    )


def _is_an_engine(engine: KvmeshEngine) -> Engine:
    return engine  # mypy checks here that KvmeshEngine implements the interface
