"""Which blocks each request holds: prefix hits, slot allocation, freeing, held exports.

The scheduler asks ``get_computed_blocks`` for a new request's prefix hits, then
``allocate_slots`` for the tokens it will compute this step (``None`` means no room: the
scheduler preempts). Full blocks are named in the prefix cache as soon as the step that
fills them is scheduled: within a step every layer writes all new K/V before any attention
reads, so a request that hits such a block in the same step reads finished data.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.engine.block_pool import BlockPool, KVBlock, KVCacheEvent
from kvmesh.engine.request import Request
from kvmesh.hashing import BlockHash, hash_token_blocks

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True, frozen=True)
class PoolStats:
    num_blocks: int
    num_free: int  # no reference (includes cached blocks that may be evicted)
    num_cached: int  # holding a named prefix block, referenced or not
    num_in_use: int  # referenced by a running request or a held export/import
    num_held: int  # of those, held for a KV export or import
    block_size: int
    num_cached_free: int | None = None  # cached and not referenced (evictable); None: the engine does not say


class KVCacheManager:
    def __init__(
        self, pool: BlockPool, *, extra_keys: Sequence[str] = (), enable_prefix_caching: bool = True
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.extra_keys = tuple(extra_keys)
        self.enable_prefix_caching = enable_prefix_caching and pool.enable_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_named: dict[str, int] = {}  # leading blocks of a request already in the cache
        self.held: dict[str, list[KVBlock]] = {}

    # -- hashes --------------------------------------------------------------------------
    def update_block_hashes(self, req: Request) -> None:
        """Extend ``req.block_hashes`` to every full block of its known tokens."""
        have = len(req.block_hashes)
        if (have + 1) * self.block_size > req.num_tokens:
            return
        parent = req.block_hashes[-1] if have else None
        req.block_hashes.extend(
            hash_token_blocks(
                req.token_ids, self.block_size, self.extra_keys, parent_hash=parent, start_block=have
            )
        )

    # -- prefix hits and allocation ------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> list[KVBlock]:
        """The longest run of leading blocks already cached, leaving one token to compute;
        none for a request that wants prompt logprobs (it needs every position's logits)."""
        if not self.enable_prefix_caching or req.sampling.prompt_logprobs is not None:
            return []
        self.update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self._leading_cached(req.block_hashes[:max_blocks])

    def _leading_cached(self, block_hashes: Sequence[BlockHash]) -> list[KVBlock]:
        """The cached blocks of a chain's leading hashes, up to the first miss."""
        blocks: list[KVBlock] = []
        for block_hash in block_hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(
        self, req: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Blocks for ``num_new_tokens`` more tokens of ``req``; ``None`` if there is no room."""
        blocks = self.req_blocks.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_needed = max(0, cdiv(total_tokens, self.block_size) - len(blocks) - len(new_computed_blocks))
        # Hits that sit on the free list stop being evictable once touched.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_evictable_hits:
            return None
        if req.request_id not in self.req_blocks:
            self.req_blocks[req.request_id] = blocks
            self._num_named[req.request_id] = 0
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self._num_named[req.request_id] += len(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_needed)
        blocks.extend(new_blocks)
        self._name_full_blocks(req, total_tokens)
        return new_blocks

    def _name_full_blocks(self, req: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        named = self._num_named[req.request_id]
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        if num_full <= named:
            return
        self.update_block_hashes(req)
        blocks = self.req_blocks[req.request_id]
        parent = req.block_hashes[named - 1] if named else None
        self.pool.cache_full_blocks(blocks[named:num_full], req.block_hashes[named:num_full], parent)
        self._num_named[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Release a request's blocks, tail first so the tail is evicted first."""
        blocks = self.req_blocks.pop(req.request_id, None)
        self._num_named.pop(req.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_blocks.get(request_id, ())]

    # -- disaggregation: blocks held for a KV export or filled by an import ---------------
    def hold(self, req: Request) -> list[int]:
        """Move a request's blocks to the held set under its id; they stay referenced."""
        if req.request_id in self.held:
            raise ValueError(f"blocks are already held under {req.request_id!r}")
        blocks = self.req_blocks.pop(req.request_id)
        self._num_named.pop(req.request_id, None)
        self.held[req.request_id] = blocks
        return [block.block_id for block in blocks]

    def allocate_held(self, handle: str, num_tokens: int) -> list[int] | None:
        """Fresh blocks for ``num_tokens`` tokens written from outside; ``None`` if no room."""
        if handle in self.held:
            raise ValueError(f"blocks are already held under {handle!r}")
        count = cdiv(num_tokens, self.block_size)
        if count > self.pool.num_free_blocks:
            return None
        blocks = self.pool.get_new_blocks(count)
        self.held[handle] = blocks
        return [block.block_id for block in blocks]

    def attach_held(self, handle: str, req: Request, num_computed_tokens: int) -> None:
        """Give held blocks (KV of ``num_computed_tokens`` tokens) to a request."""
        if req.request_id in self.req_blocks:
            raise ValueError(f"request {req.request_id!r} already has blocks")
        blocks = self.held.pop(handle)
        if len(blocks) != cdiv(num_computed_tokens, self.block_size):
            self.held[handle] = blocks
            raise ValueError(f"{len(blocks)} held blocks do not fit {num_computed_tokens} tokens")
        self.req_blocks[req.request_id] = blocks
        self._num_named[req.request_id] = 0
        req.num_computed_tokens = num_computed_tokens
        self._name_full_blocks(req, num_computed_tokens)

    def hold_cached(self, handle: str, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Reference the leading blocks of ``block_hashes`` found in the cache (stopping at
        the first miss) under ``handle``, so a peer can read them; ``release_held`` frees."""
        if handle in self.held:
            raise ValueError(f"blocks are already held under {handle!r}")
        blocks = self._leading_cached(block_hashes)
        self.pool.touch(blocks)
        self.held[handle] = blocks
        return [block.block_id for block in blocks]

    def cache_held(self, handle: str, block_hashes: Sequence[BlockHash], parent_hash: BlockHash | None) -> None:
        """Name held blocks (written from outside) in the prefix cache, then let them go:
        they stay cached until evicted."""
        blocks = self.held.pop(handle)
        if len(blocks) != len(block_hashes):
            self.held[handle] = blocks
            raise ValueError(f"{len(blocks)} held blocks for {len(block_hashes)} hashes")
        self.pool.cache_full_blocks(blocks, block_hashes, parent_hash)
        self.pool.free_blocks(reversed(blocks))

    def cached_prefix_length(self, block_hashes: Sequence[BlockHash]) -> int:
        return len(self._leading_cached(block_hashes))

    def release_held(self, handle: str) -> bool:
        blocks = self.held.pop(handle, None)
        if blocks is None:
            return False
        self.pool.free_blocks(reversed(blocks))
        return True

    # -- reporting -----------------------------------------------------------------------
    def take_events(self) -> list[KVCacheEvent]:
        return self.pool.take_events()

    def stats(self) -> PoolStats:
        free = self.pool.num_free_blocks
        return PoolStats(
            num_blocks=self.pool.num_blocks,
            num_free=free,
            num_cached=self.pool.num_cached_blocks,
            num_in_use=self.pool.num_blocks - free,
            num_held=sum(len(blocks) for blocks in self.held.values()),
            block_size=self.block_size,
            num_cached_free=sum(1 for block in self.pool.cached.values() if block.ref_cnt == 0),
        )
