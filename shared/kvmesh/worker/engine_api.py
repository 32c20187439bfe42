"""The one interface between a worker and the engine it hosts, and the data that crosses it.

Services (the runtime, the prefill and decode workers, the KV event publisher) see an
engine only through ``Engine``: they never reach into an engine's internals and never know
which engine they host. kvmesh's own engine implements it (``kvmesh.worker.engines``); an
engine is chosen by name with ``create_engine``.

A request's outputs are ``RequestOutput``s; a prefill kept for export ends with one whose
``kv_export`` names the blocks holding its KV. Blocks are named by their index in the pool,
and where a block's bytes lie is said by the pool's ``PoolLayout``, which the worker
publishes. An engine that has stopped raises ``EngineDeadError``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from kvmesh.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvmesh.engine.core_lending import LendingCounts
from kvmesh.engine.kv_cache_manager import PoolStats
from kvmesh.engine.outputs import KVExport, RequestOutput, StepObserver
from kvmesh.engine.request import FinishReason, SamplingParams
from kvmesh.errors import EngineDeadError
from kvmesh.transfer.layout import PoolLayout

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Engine",
    "EngineDeadError",
    "FinishReason",
    "KVCacheEvent",
    "KVExport",
    "PoolLayout",
    "PoolStats",
    "RequestOutput",
    "SamplingParams",
    "StepObserver",
]


class Engine(Protocol):
    # -- what it serves and where its KV lies ----------------------------------------------
    @property
    def model_name(self) -> str:
        """The served model's name; it also keys the block hashes."""
        ...

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt and output) it can hold."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def kv_layout(self) -> PoolLayout:
        """Its KV pool, allocated once at start: registered with the transfer engine and
        published in the worker's record."""
        ...

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        """The chained hashes of the full blocks of ``token_ids`` (the mesh's one function,
        at the pool's block size)."""
        ...

    # -- requests ------------------------------------------------------------------------
    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None, *, first: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Run a request (``first``: ahead of those waiting) and iterate its outputs until
        one is ``finished``; leaving early aborts it."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Stop a request; its stream ends with an ``abort`` output. False: not there."""
        ...

    # -- prefill for export (prefill workers) ----------------------------------------------
    async def prefill_export(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None, *, first: bool = False
    ) -> RequestOutput:
        """Prefill and sample the first token; the blocks stay held (``out.kv_export``)
        until ``release_export``."""
        ...

    async def release_export(self, request_id: str) -> bool:
        """Free the blocks of an export or a lend (after the peer pulled them)."""
        ...

    # -- decode from imported KV (decode workers, and prefix pulls) ------------------------
    async def allocate_import(
        self, handle: str, num_tokens: int, params: SamplingParams | None = None, resumed: bool = False
    ) -> list[int] | None:
        """Blocks, held under ``handle``, to receive the KV of ``num_tokens`` tokens from a
        peer; ``None`` when there is no room. With ``params``, of the request to decode from
        that KV (``generate_from_import``), an engine that reserves room for the running
        requests' growth (kvmesh's) also says ``None`` where its admission would hold that
        request back now, unless it is ``resumed`` (mid-answer: it counts the request's
        growth but takes the blocks wherever they fit); vLLM's takes them wherever they fit."""
        ...

    async def release_import(self, handle: str) -> bool:
        """Give back the blocks of ``allocate_import`` (a no-op once a request took them)."""
        ...

    def generate_from_import(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        handle: str,
        params: SamplingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Decode a request whose prompt KV was written into the blocks of ``handle``; the
        first output carries ``first_token_id``."""
        ...

    # -- cached blocks shared with peers -------------------------------------------------
    async def cached_prefix_length(self, block_hashes: list[int]) -> int:
        """How many leading blocks of the chain this engine holds."""
        ...

    async def lend_cached_blocks(self, handle: str, block_hashes: list[int]) -> list[int]:
        """Hold the leading cached blocks of a chain under ``handle`` for a peer to read
        (``release_export``); returns their ids."""
        ...

    async def cache_imported_blocks(self, handle: str, block_hashes: list[int], parent_hash: int | None) -> None:
        """The blocks of ``allocate_import(handle, ...)`` now hold these blocks' KV: cache them."""
        ...

    # -- reporting -----------------------------------------------------------------------
    async def take_kv_events(self) -> list[KVCacheEvent]:
        """The pool's events since the last call."""
        ...

    async def kv_snapshot(self) -> tuple[list[KVCacheEvent], list[int]]:
        """Pending events and every cached block hash, taken together."""
        ...

    async def pool_stats(self) -> PoolStats: ...

    def load_now(self) -> dict[str, int]:
        """``running``, ``waiting`` and ``free_blocks``, read without waiting for the engine
        (kvmesh's engine adds ``reserved_blocks``: the free ones its admission keeps back for
        the running requests' growth)."""
        ...

    def lending_counts(self) -> LendingCounts | None:
        """What lending cores between engines did (``--lend-cores``), read without waiting for
        the engine; None for an engine that does not lend."""
        ...

    def observe_steps(self, observer: StepObserver) -> None:
        """Tell ``observer`` of every request's arrival and end and of every engine step
        (its outputs, its time), as they happen: the worker's metrics."""
        ...

    # -- liveness and lifetime -----------------------------------------------------------
    def is_alive(self) -> bool: ...

    def heartbeat_age(self) -> float:
        """Seconds since the engine last went round its loop."""
        ...

    async def wait_dead(self) -> BaseException | None:
        """Return once the engine has stopped: the error that stopped it, or ``None``."""
        ...

    async def shutdown(self) -> None: ...
