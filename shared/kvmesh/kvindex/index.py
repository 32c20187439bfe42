"""The cluster-wide index of KV blocks: block hash -> the workers that hold it, and in which tier.

Fed by the workers' KV events (``stored``, ``removed``; ``remove_worker`` when a worker dies
or restarts), it answers the router's question: for this chain of block hashes, how many
leading blocks does each worker hold?

Layout, chosen so that ``prefix_match`` is a handful of dict lookups and integer ``&`` per
block: each worker id is interned to a small slot number, and the owners of a hash are one
Python int used as a bitmask of slots (``_owners``). Each slot also keeps ``hash -> tier``
for its blocks (``_blocks``), which gives ``remove_worker`` its O(blocks of that worker) cost
and the tier of every (hash, worker) pair. A freed slot is reused only after every one of its
bits has been cleared, so a stale bit can never name a new worker.

A block is in one tier per worker: storing it again with another tier moves it there (the
latest report wins) and does not count as newly added.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Sequence

from kvmesh.hashing import BlockHash

logger = logging.getLogger(__name__)

DEFAULT_TIER = "device"


class KVIndex:
    """Block hash -> owners (worker, tier), with a prefix match over chains of hashes."""

    def __init__(self) -> None:
        self._owners: dict[BlockHash, int] = {}  # hash -> bitmask of worker slots
        self._blocks: list[dict[BlockHash, int] | None] = []  # slot -> {hash: tier id}
        self._slot_of: dict[str, int] = {}
        self._name_of: list[str | None] = []
        self._free_slots: list[int] = []  # a heap: the lowest free slot keeps masks small
        self._tier_id: dict[str, int] = {}
        self._tier_name: list[str] = []

    # -- events ------------------------------------------------------------------------

    def stored(self, worker_id: str, block_hashes: Sequence[BlockHash], tier: str = DEFAULT_TIER) -> int:
        """Record that ``worker_id`` holds ``block_hashes`` in ``tier``; returns how many
        (hash, worker) pairs are new."""
        slot = self._slot(worker_id)
        bit = 1 << slot
        tier_id = self._intern_tier(tier)
        blocks = self._blocks[slot]
        assert blocks is not None
        owners = self._owners
        added = 0
        for block_hash in block_hashes:
            if block_hash not in blocks:
                owners[block_hash] = owners.get(block_hash, 0) | bit
                added += 1
            blocks[block_hash] = tier_id
        return added

    def removed(self, worker_id: str, block_hashes: Iterable[BlockHash], tier: str | None = None) -> int:
        """Record that ``worker_id`` dropped ``block_hashes``; returns how many it held.

        With ``tier``, only blocks recorded in that tier are dropped (a block evicted from the
        device after it was offloaded to the host stays, in the host tier).
        """
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return 0
        blocks = self._blocks[slot]
        assert blocks is not None
        only_tier = None if tier is None else self._tier_id.get(tier, -1)
        clear = ~(1 << slot)
        owners = self._owners
        dropped = 0
        for block_hash in block_hashes:
            held_tier = blocks.get(block_hash)
            if held_tier is None or (only_tier is not None and held_tier != only_tier):
                continue
            del blocks[block_hash]
            mask = owners[block_hash] & clear
            if mask:
                owners[block_hash] = mask
            else:
                del owners[block_hash]
            dropped += 1
        return dropped

    def remove_worker(self, worker_id: str) -> int:
        """Forget ``worker_id`` and every block it held; returns how many blocks it held."""
        slot = self._slot_of.pop(worker_id, None)
        if slot is None:
            return 0
        blocks = self._blocks[slot]
        assert blocks is not None
        clear = ~(1 << slot)
        owners = self._owners
        for block_hash in blocks:
            mask = owners[block_hash] & clear
            if mask:
                owners[block_hash] = mask
            else:
                del owners[block_hash]
        self._blocks[slot] = None
        self._name_of[slot] = None
        heapq.heappush(self._free_slots, slot)
        logger.debug("removed worker %s with %d blocks", worker_id, len(blocks))
        return len(blocks)

    # -- queries -----------------------------------------------------------------------

    def prefix_match(self, chain: Sequence[BlockHash], tiers: Iterable[str] | None = None) -> dict[str, int]:
        """For each worker holding ``chain[0]``, how many leading blocks of ``chain`` it holds.

        A worker's count stops at its first missing block. ``tiers`` limits the match to
        blocks held in those tiers (default: any tier).
        """
        if not chain:
            return {}
        tier_ids = None if tiers is None else {self._tier_id.get(t, -1) for t in tiers}
        owners = self._owners
        alive = owners.get(chain[0], 0)
        if tier_ids is not None:
            alive = self._in_tiers(chain[0], alive, tier_ids)
        if not alive:
            return {}
        counts: dict[str, int] = {}
        matched = 1
        for block_hash in chain[1:]:
            still = alive & owners.get(block_hash, 0)
            if tier_ids is not None:
                still = self._in_tiers(block_hash, still, tier_ids)
            if still != alive:
                self._credit(alive & ~still, matched, counts)
                alive = still
                if not alive:
                    return counts
            matched += 1
        self._credit(alive, matched, counts)
        return counts

    def _in_tiers(self, block_hash: BlockHash, mask: int, tier_ids: set[int]) -> int:
        """The bits of ``mask`` whose worker holds ``block_hash`` in one of ``tier_ids``."""
        kept = 0
        rest = mask
        while rest:
            low = rest & -rest
            blocks = self._blocks[low.bit_length() - 1]
            assert blocks is not None
            if blocks[block_hash] in tier_ids:
                kept |= low
            rest ^= low
        return kept

    def _credit(self, mask: int, matched: int, counts: dict[str, int]) -> None:
        names = self._name_of
        while mask:
            low = mask & -mask
            name = names[low.bit_length() - 1]
            assert name is not None
            counts[name] = matched
            mask ^= low

    def owners(self, block_hash: BlockHash) -> dict[str, str]:
        """Worker -> tier for every worker holding ``block_hash``."""
        out: dict[str, str] = {}
        mask = self._owners.get(block_hash, 0)
        while mask:
            low = mask & -mask
            slot = low.bit_length() - 1
            blocks, name = self._blocks[slot], self._name_of[slot]
            assert blocks is not None and name is not None
            out[name] = self._tier_name[blocks[block_hash]]
            mask ^= low
        return out

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._owners)

    @property
    def num_entries(self) -> int:
        """(hash, worker) pairs."""
        return sum(len(blocks) for blocks in self._blocks if blocks is not None)

    def workers(self) -> list[str]:
        """Workers known to the index (from their first ``stored`` until ``remove_worker``), sorted."""
        return sorted(self._slot_of)

    def holds(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> set[BlockHash]:
        """Which of ``block_hashes`` ``worker_id`` holds (in any tier)."""
        slot = self._slot_of.get(worker_id)
        blocks = self._blocks[slot] if slot is not None else None
        return {h for h in block_hashes if blocks is not None and h in blocks}

    def blocks_of(self, worker_id: str) -> int:
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return 0
        blocks = self._blocks[slot]
        assert blocks is not None
        return len(blocks)

    # -- interning ---------------------------------------------------------------------

    def _slot(self, worker_id: str) -> int:
        slot = self._slot_of.get(worker_id)
        if slot is not None:
            return slot
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
            self._blocks[slot] = {}
            self._name_of[slot] = worker_id
        else:
            slot = len(self._blocks)
            self._blocks.append({})
            self._name_of.append(worker_id)
        self._slot_of[worker_id] = slot
        return slot

    def _intern_tier(self, tier: str) -> int:
        tier_id = self._tier_id.get(tier)
        if tier_id is None:
            tier_id = self._tier_id[tier] = len(self._tier_name)
            self._tier_name.append(tier)
        return tier_id
