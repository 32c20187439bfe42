"""vLLM's KV events in kvmesh's terms: the queue that stands in for the scheduler's KV event
publisher (in this process, no ZMQ), and the names kvmesh gives vLLM's blocks (its block
hashes, chained from the events' token ids), both ways: vLLM's hash to kvmesh's for the
events the worker publishes, kvmesh's to vLLM's for looking a block up in vLLM's prefix
cache (a lend). Free of vLLM's imports."""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

from kvmesh.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvmesh.hashing import BlockHash, hash_token_blocks

logger = logging.getLogger(__name__)


class EventQueue:
    """Stands in for the scheduler's KV event publisher: keeps vLLM's batches for ``take``."""

    def __init__(self) -> None:
        self._batches: deque[Any] = deque()
        self._lock = threading.Lock()

    def publish(self, events: Any) -> None:
        with self._lock:
            self._batches.append(events)

    def take(self) -> list[Any]:
        with self._lock:
            batches, self._batches = list(self._batches), deque()
        return [event for batch in batches for event in batch.events]

    def shutdown(self) -> None:
        pass

    def get_publisher_config(self) -> None:
        return None


class KVEventNames:
    """vLLM's block hashes to kvmesh's: a stored block's name is chained from its parent's
    kvmesh name and its token ids, with the served model as extra key; a hash vLLM stores
    twice (two blocks) is named once and removed with its last block."""

    def __init__(self, block_size: int, model_name: str) -> None:
        self.block_size = block_size
        self.extra_keys = (model_name,)
        self._names: dict[Any, tuple[BlockHash, int]] = {}  # vLLM hash -> (kvmesh hash, blocks)
        self._vllm: dict[BlockHash, Any] = {}  # kvmesh hash -> a vLLM hash named so

    def translate(self, events: list[Any]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                stored = self._stored(event)
                if stored is not None:
                    out.append(stored)
            elif kind == "BlockRemoved":
                removed = self._removed(event.block_hashes)
                if removed:
                    out.append(BlockRemoved(tuple(removed)))
            elif kind == "AllBlocksCleared":
                self._names.clear()
                self._vllm.clear()
                out.append(AllBlocksCleared())
        return out

    def _stored(self, event: Any) -> BlockStored | None:
        if event.block_size != self.block_size:
            logger.warning("a vLLM KV event for blocks of %d tokens, not %d: dropped", event.block_size, self.block_size)
            return None
        parent: BlockHash | None = None
        if event.parent_block_hash is not None:
            known = self._names.get(event.parent_block_hash)
            if known is None:  # its parent was never announced (or is gone): neither can its chain be
                logger.debug("a vLLM KV event whose parent block is unknown: dropped")
                return None
            parent = known[0]
        names = hash_token_blocks(event.token_ids, self.block_size, self.extra_keys, parent_hash=parent)
        fresh: list[BlockHash] = []
        first_parent = parent
        for vllm_hash, name in zip(event.block_hashes, names):
            seen = self._names.get(vllm_hash)
            self._names[vllm_hash] = (name, seen[1] + 1 if seen else 1)
            self._vllm[name] = vllm_hash
            if seen is None:
                fresh.append(name)
            elif not fresh:
                first_parent = name  # the announced chain starts after the blocks already known
        if not fresh:
            return None
        return BlockStored(tuple(fresh), first_parent, (), self.block_size)

    def _removed(self, vllm_hashes: list[Any]) -> list[BlockHash]:
        gone: list[BlockHash] = []
        for vllm_hash in vllm_hashes:
            seen = self._names.get(vllm_hash)
            if seen is None:
                continue
            name, count = seen
            if count > 1:
                self._names[vllm_hash] = (name, count - 1)
            else:
                del self._names[vllm_hash]
                if self._vllm.get(name) == vllm_hash:
                    del self._vllm[name]
                gone.append(name)
        return gone

    def cached(self) -> list[BlockHash]:
        return [name for name, _ in self._names.values()]

    def vllm_hash(self, name: BlockHash) -> Any:
        """vLLM's hash of the block kvmesh names ``name`` (None: not announced, or gone)."""
        return self._vllm.get(name)
