"""The KV block pool: reference counts, an O(1) LRU free list, a hash -> block map, events.

In the manner of vLLM's ``BlockPool``: a block whose reference count drops to zero goes to
the tail of the free list but keeps its hash, so a later request with the same prefix can
take it back (a cache hit). Eviction is lazy: a cached block loses its hash only when the
free list hands it out for new data, and that is when ``BlockRemoved`` is queued.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvmesh.hashing import BlockHash

logger = logging.getLogger(__name__)


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than the free list holds."""


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    epoch: int = 0  # how many times the block was taken for new content: (id, epoch) names its bytes
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


@dataclass(slots=True, frozen=True)
class BlockStored:
    """Blocks that now hold reusable KV for a chain of hashes (parent first to child)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    block_ids: tuple[int, ...]
    block_size: int


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks, least recently freed first.

    ``remove`` is O(1): a block taken back by a cache hit leaves from the middle.
    """

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise NoFreeBlocksError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the free list"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} is already free"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def block_ids(self) -> list[int]:
        return [block.block_id for block in self]


class BlockPool:
    """All KV blocks of one worker, with reference counts and the prefix-cache index."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVCacheEvent] = []

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference: empty ones and cached ones that may be evicted."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    # -- allocation ----------------------------------------------------------------------
    def get_new_blocks(self, count: int) -> list[KVBlock]:
        """Take ``count`` blocks off the head of the free list, evicting their old hashes."""
        if count > len(self.free_queue):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self.free_queue)} free")
        taken: list[KVBlock] = []
        evicted: list[BlockHash] = []
        for _ in range(count):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            block.epoch += 1
            taken.append(block)
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the cache; free ones leave the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free list in this order."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    # -- prefix cache --------------------------------------------------------------------
    def cache_full_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
    ) -> None:
        """Record that ``blocks`` hold the full blocks named by ``block_hashes``.

        A hash already cached in another block (two requests computed the same block at
        once) is left to that block; this one stays unnamed and is reused when freed.
        """
        if not self.enable_caching:
            return
        assert len(blocks) == len(block_hashes)
        run_hashes: list[BlockHash] = []
        run_ids: list[int] = []
        run_parent = previous = parent_block_hash
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is None and block_hash not in self.cached:
                if not run_hashes:
                    run_parent = previous
                block.block_hash = block_hash
                self.cached[block_hash] = block
                run_hashes.append(block_hash)
                run_ids.append(block.block_id)
            elif run_hashes:
                self._flush_stored(run_hashes, run_ids, run_parent)
                run_hashes, run_ids = [], []
            previous = block_hash
        if run_hashes:
            self._flush_stored(run_hashes, run_ids, run_parent)

    def _flush_stored(self, hashes: list[BlockHash], ids: list[int], parent: BlockHash | None) -> None:
        self._events.append(BlockStored(tuple(hashes), parent, tuple(ids), self.block_size))

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Take the prefix-cache names back from blocks whose KV was never written (a failed
        step), so no later request reads them as a hit; a ``BlockRemoved`` says so."""
        hashes = tuple(b.block_hash for b in blocks if b.block_hash is not None and self.cached.get(b.block_hash) is b)
        for block_hash in hashes:
            self.cached.pop(block_hash).block_hash = None
        if hashes:
            self._events.append(BlockRemoved(hashes))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is referenced."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def has_events(self) -> bool:
        """Are events waiting? Safe to ask from another thread: an event that lands just after
        is there for the next ask."""
        return bool(self._events)

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
