"""KVCacheManager: prefix hits, slot allocation, freeing order, held exports/imports, stats."""

from __future__ import annotations

import pytest

from kvmesh.engine.block_pool import BlockPool, BlockRemoved, BlockStored
from kvmesh.engine.kv_cache_manager import KVCacheManager, PoolStats, cdiv
from kvmesh.engine.request import Request, SamplingParams
from kvmesh.hashing import hash_token_blocks

BS = 4
KEYS = ("m",)


def make_kv(num_blocks: int = 10, **kw: object) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, block_size=BS), extra_keys=KEYS, **kw)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def ids(blocks: list) -> list[int]:
    return [b.block_id for b in blocks]


def admit(kv: KVCacheManager, r: Request, num_new: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: hits, then slots for the rest."""
    hits = kv.get_computed_blocks(r)
    hit_tokens = len(hits) * BS
    if num_new is None:
        num_new = r.num_tokens - hit_tokens
    new = kv.allocate_slots(r, num_new, hits)
    if new is None:
        return None
    r.num_computed_tokens = hit_tokens
    return ids(new)


def compute(r: Request, num_new: int) -> None:
    r.num_computed_tokens += num_new


def test_cdiv() -> None:
    assert [cdiv(n, 4) for n in range(0, 10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_first_request_allocates_and_names_full_blocks() -> None:
    kv = make_kv()
    r1 = req("r1", list(range(10)))
    assert kv.get_computed_blocks(r1) == []
    h = hash_token_blocks(list(range(10)), BS, KEYS)
    assert r1.block_hashes == h and len(h) == 2
    new = kv.allocate_slots(r1, 10, [])
    assert ids(new) == [0, 1, 2]
    assert kv.block_ids("r1") == [0, 1, 2]
    assert [b.ref_cnt for b in new] == [1, 1, 1]
    # The two full blocks are named now (the step that fills them is scheduled); the third is not.
    assert {k: b.block_id for k, b in kv.pool.cached.items()} == {h[0]: 0, h[1]: 1}
    assert new[2].block_hash is None
    assert kv.take_events() == [BlockStored((h[0], h[1]), None, (0, 1), BS)]
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9]
    assert kv.block_ids("nobody") == []


def test_shared_prefix_hits_and_tail_first_freeing() -> None:
    kv = make_kv()
    r1 = req("r1", list(range(10)))
    assert admit(kv, r1) == [0, 1, 2]
    compute(r1, 10)
    kv.take_events()

    # r2 shares the first 8 tokens (two full blocks) and then diverges.
    r2 = req("r2", list(range(8)) + [50, 51, 52])
    hits = kv.get_computed_blocks(r2)
    assert ids(hits) == [0, 1]
    assert kv.allocate_slots(r2, 3, hits) is not None
    r2.num_computed_tokens = 8
    assert kv.block_ids("r2") == [0, 1, 3]
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    # r2's only full block beyond the hits would be block 2 (tokens 8..11): not full yet.
    assert kv.take_events() == []

    # A prompt of exactly 8 tokens: one token must be left to compute, so only 1 hit.
    r3 = req("r3", list(range(8)))
    hits3 = kv.get_computed_blocks(r3)
    assert ids(hits3) == [0]
    assert kv.allocate_slots(r3, 4, hits3) is not None
    assert kv.block_ids("r3") == [0, 4]
    # r3's second block holds the same tokens as block 1: h1 stays with block 1, block 4 unnamed.
    assert kv.pool.cached[r3.block_hashes[1]].block_id == 1
    assert kv.pool.blocks[4].block_hash is None
    assert kv.take_events() == []
    assert [b.ref_cnt for b in kv.pool.blocks[:5]] == [3, 2, 1, 1, 1]

    # Freeing goes tail first: r1 releases 2, 1, 0 but only block 2 reaches zero.
    kv.free(r1)
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 2]
    kv.free(r3)
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 2, 4]
    kv.free(r2)
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 2, 4, 3, 1, 0]
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.req_blocks == {} and kv._num_named == {}
    # Freeing an unknown or already freed request is harmless.
    kv.free(r2)
    assert kv.pool.num_free_blocks == 10

    # The prefix survives on the free list: a new request takes blocks 0 and 1 back from it.
    r4 = req("r4", list(range(8)) + [7, 7])
    assert admit(kv, r4) == [5]
    assert kv.block_ids("r4") == [0, 1, 5]
    assert kv.pool.free_queue.block_ids() == [6, 7, 8, 9, 2, 4, 3]
    assert r4.num_computed_tokens == 8


def test_allocate_slots_none_when_pool_is_short() -> None:
    kv = make_kv()
    r1 = req("r1", list(range(10)))
    admit(kv, r1)
    compute(r1, 10)
    kv.free(r1)
    kv.take_events()
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]

    # Two blocks go to someone else: 8 free, 2 of which (0, 1) are r2's hits.
    other = req("other", [99] * 6)
    assert admit(kv, other) == [3, 4]
    assert kv.pool.num_free_blocks == 8
    assert kv.take_events() == [BlockStored((other.block_hashes[0],), None, (3,), BS)]

    # r2: 8 shared + 25 tokens = 33 tokens = 9 blocks; 2 are hits, 7 new are needed.
    # 7 <= 8 free, but touching the hits takes 2 off the free list: only 6 remain.
    r2 = req("r2", list(range(8)) + [60] * 25)
    before = (kv.pool.free_queue.block_ids(), [b.ref_cnt for b in kv.pool.blocks], dict(kv.pool.cached))
    assert admit(kv, r2) is None
    after = (kv.pool.free_queue.block_ids(), [b.ref_cnt for b in kv.pool.blocks], dict(kv.pool.cached))
    assert before == after
    assert "r2" not in kv.req_blocks
    assert kv.take_events() == []

    # One token fewer of new blocks fits exactly (6 new blocks + 2 hits).
    r2b = req("r2b", list(range(8)) + [60] * 24)
    assert admit(kv, r2b) == [5, 6, 7, 8, 9, 2]
    assert kv.block_ids("r2b") == [0, 1, 5, 6, 7, 8, 9, 2]
    assert kv.pool.num_free_blocks == 0
    # Block 2 was r1's unnamed tail: nothing evicted.
    assert not any(isinstance(e, BlockRemoved) for e in kv.take_events())


def test_hits_held_by_others_do_not_count_against_free() -> None:
    kv = make_kv(5)
    r1 = req("r1", list(range(9)))
    assert admit(kv, r1) == [0, 1, 2]
    compute(r1, 9)
    # r1 still holds blocks 0 and 1: r2 hits them without using free space.
    # r2 = 8 shared + 8 new tokens = 4 blocks, 2 hits, 2 needed, 2 free.
    r2 = req("r2", list(range(8)) + [70] * 8)
    assert admit(kv, r2) == [3, 4]
    assert kv.block_ids("r2") == [0, 1, 3, 4]
    assert kv.pool.num_free_blocks == 0
    assert admit(kv, req("r3", [1])) is None


def test_decode_growth_allocates_only_at_block_boundaries() -> None:
    kv = make_kv()
    r = req("r", list(range(6)))
    assert admit(kv, r) == [0, 1]
    compute(r, 6)
    h = hash_token_blocks(list(range(6)), BS, KEYS)
    assert kv.take_events() == [BlockStored((h[0],), None, (0,), BS)]
    grown = []
    for token in [100, 101, 102, 103, 104]:
        r.token_ids.append(token)  # the sampled token; its KV is computed next step
        new = kv.allocate_slots(r, 1)
        assert new is not None
        grown.append(ids(new))
        compute(r, 1)
    # 7 and 8 tokens fit in 2 blocks; the 9th token needs block 2; 10 and 11 fit in it.
    assert grown == [[], [], [2], [], []]
    assert kv.block_ids("r") == [0, 1, 2]
    # Block 1 became full at 8 tokens and was named with the generated token in it.
    h_all = hash_token_blocks(r.token_ids, BS, KEYS)
    assert r.block_hashes == h_all[:2]
    assert kv.take_events() == [BlockStored((h_all[1],), h_all[0], (1,), BS)]
    assert kv.pool.cached[h_all[1]].block_id == 1


def test_chunked_allocation_names_blocks_as_they_fill() -> None:
    kv = make_kv()
    tokens = list(range(14))
    h = hash_token_blocks(tokens, BS, KEYS)
    r = req("r", tokens)
    assert admit(kv, r, num_new=5) == [0, 1]
    assert kv.take_events() == [BlockStored((h[0],), None, (0,), BS)]
    compute(r, 5)
    assert ids(kv.allocate_slots(r, 5)) == [2]  # 10 tokens: blocks 0..2, two of them full
    assert kv.take_events() == [BlockStored((h[1],), h[0], (1,), BS)]
    compute(r, 5)
    assert ids(kv.allocate_slots(r, 4)) == [3]  # 14 tokens: block 2 fills, block 3 partial
    assert kv.take_events() == [BlockStored((h[2],), h[1], (2,), BS)]
    assert kv.block_ids("r") == [0, 1, 2, 3]
    # A one-shot allocation of several full blocks is a single run in one event.
    r2 = req("r2", list(range(100, 113)))
    assert admit(kv, r2) == [4, 5, 6, 7]
    assert kv.take_events() == [BlockStored(tuple(r2.block_hashes), None, (4, 5, 6), BS)]


def test_prefix_caching_disabled() -> None:
    kv = make_kv(enable_prefix_caching=False)
    r1 = req("r1", list(range(10)))
    assert admit(kv, r1) == [0, 1, 2]
    assert kv.pool.cached == {}
    assert kv.take_events() == []
    r2 = req("r2", list(range(10)))
    assert kv.get_computed_blocks(r2) == []
    assert admit(kv, r2) == [3, 4, 5]


def test_hold_survives_free_and_release() -> None:
    kv = make_kv()
    r = req("exp", list(range(10)))
    admit(kv, r)
    compute(r, 10)
    r.token_ids.append(5)
    assert kv.hold(r) == [0, 1, 2]
    assert kv.req_blocks == {}
    assert ids(kv.held["exp"]) == [0, 1, 2]
    kv.free(r)  # the request is gone; its blocks stay held
    assert [b.ref_cnt for b in kv.pool.blocks[:3]] == [1, 1, 1]
    s = kv.stats()
    assert (s.num_free, s.num_in_use, s.num_held, s.num_cached) == (7, 3, 3, 2)
    # Held full blocks are still prefix hits for others.
    r2 = req("r2", list(range(9)))
    assert ids(kv.get_computed_blocks(r2)) == [0, 1]
    assert kv.release_held("exp") is True
    assert kv.release_held("exp") is False
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert kv.stats().num_held == 0


def test_allocate_held_and_attach_held() -> None:
    kv = make_kv()
    assert kv.allocate_held("imp", 10) == [0, 1, 2]
    with pytest.raises(ValueError, match="already held"):
        kv.allocate_held("imp", 4)
    assert kv.stats().num_held == 3
    assert kv.take_events() == []  # nothing named until the KV belongs to a request

    tokens = list(range(20, 30))
    h = hash_token_blocks(tokens, BS, KEYS)
    r = req("dec", tokens)
    # The wrong number of tokens for the blocks raises, and the blocks stay held.
    with pytest.raises(ValueError, match="3 held blocks do not fit 13 tokens"):
        kv.attach_held("imp", r, 13)
    with pytest.raises(ValueError, match="3 held blocks do not fit 8 tokens"):
        kv.attach_held("imp", r, 8)
    assert ids(kv.held["imp"]) == [0, 1, 2]
    assert r.num_computed_tokens == 0 and "dec" not in kv.req_blocks

    kv.attach_held("imp", r, 10)
    assert kv.held == {}
    assert kv.block_ids("dec") == [0, 1, 2]
    assert r.num_computed_tokens == 10
    assert kv.take_events() == [BlockStored((h[0], h[1]), None, (0, 1), BS)]
    assert {k: b.block_id for k, b in kv.pool.cached.items()} == {h[0]: 0, h[1]: 1}
    assert kv.stats().num_held == 0 and kv.stats().num_in_use == 3

    # Decoding on from the import: the 11th and 12th tokens fit in block 2; 12 names it.
    r.token_ids.append(30)
    assert kv.allocate_slots(r, 1) == []
    compute(r, 1)
    r.token_ids.append(31)
    assert kv.allocate_slots(r, 1) == []
    assert [type(e) for e in kv.take_events()] == [BlockStored]

    # A request that already has blocks cannot take held ones.
    kv.allocate_held("imp2", 1)
    with pytest.raises(ValueError, match="already has blocks"):
        kv.attach_held("imp2", r, 1)
    assert ids(kv.held["imp2"]) == [3]
    with pytest.raises(KeyError):
        kv.attach_held("missing", req("x", [1]), 1)


def test_allocate_held_when_short() -> None:
    kv = make_kv(3)
    assert kv.allocate_held("a", 13) is None
    assert kv.held == {}
    assert kv.pool.num_free_blocks == 3
    assert kv.allocate_held("a", 12) == [0, 1, 2]
    assert kv.allocate_held("b", 1) is None
    assert kv.release_held("a") is True
    assert kv.pool.free_queue.block_ids() == [2, 1, 0]
    assert kv.release_held("b") is False


def test_stats_fields() -> None:
    kv = make_kv(8)
    assert kv.stats() == PoolStats(num_blocks=8, num_free=8, num_cached=0, num_in_use=0, num_held=0, block_size=4, num_cached_free=0)
    r1 = req("r1", list(range(9)))
    admit(kv, r1)
    compute(r1, 9)
    kv.allocate_held("imp", 5)
    assert kv.stats() == PoolStats(num_blocks=8, num_free=3, num_cached=2, num_in_use=5, num_held=2, block_size=4, num_cached_free=0)
    kv.free(r1)
    # Cached blocks that are free still count as cached (and as free, and as cached and free).
    assert kv.stats() == PoolStats(num_blocks=8, num_free=6, num_cached=2, num_in_use=2, num_held=2, block_size=4, num_cached_free=2)
    kv.release_held("imp")
    assert kv.stats() == PoolStats(num_blocks=8, num_free=8, num_cached=2, num_in_use=0, num_held=0, block_size=4, num_cached_free=2)
