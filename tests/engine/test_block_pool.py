"""BlockPool: ref counts, the intrusive LRU free list, lazy eviction, the hash index, events."""

from __future__ import annotations

import pytest

from kvmesh.engine.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeBlockQueue,
    KVBlock,
    NoFreeBlocksError,
)
from kvmesh.hashing import hash_token_blocks

BS = 4
H = hash_token_blocks(list(range(40)), BS, ("m",))  # ten chained hashes h0..h9


def make_pool(num_blocks: int = 11, **kw: object) -> BlockPool:
    return BlockPool(num_blocks, block_size=BS, **kw)


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def assert_free_list_consistent(pool: BlockPool) -> None:
    """Forward and backward links agree and the length counter matches."""
    forward = pool.free_queue.block_ids()
    backward = []
    node = pool.free_queue._tail.prev_free
    while node is not pool.free_queue._head:
        backward.append(node.block_id)
        node = node.prev_free
    assert backward == forward[::-1]
    assert len(pool.free_queue) == len(forward) == pool.num_free_blocks
    for block in pool.blocks:
        assert (block.block_id in forward) == (block.ref_cnt == 0)


def test_initial_state() -> None:
    pool = make_pool()
    assert pool.free_queue.block_ids() == list(range(11))
    assert pool.num_free_blocks == 11
    assert pool.num_cached_blocks == 0
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)
    assert pool.take_events() == []
    assert_free_list_consistent(pool)


@pytest.mark.parametrize("n", [0, -3])
def test_pool_needs_blocks(n: int) -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        make_pool(n)


def test_get_new_blocks_pops_from_head() -> None:
    pool = make_pool()
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2]
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.free_queue.block_ids() == list(range(3, 11))
    b = pool.get_new_blocks(2)
    assert ids(b) == [3, 4]
    assert pool.get_new_blocks(0) == []
    assert pool.num_free_blocks == 6
    assert pool.take_events() == []  # nothing was cached, nothing evicted
    assert_free_list_consistent(pool)


def test_free_blocks_appends_in_given_order() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(5)  # 0..4
    pool.free_blocks([blocks[3], blocks[0], blocks[4]])
    assert pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 10, 3, 0, 4]
    assert [b.ref_cnt for b in blocks] == [0, 1, 1, 0, 0]
    # The next allocation still takes the least recently freed first.
    assert ids(pool.get_new_blocks(7)) == [5, 6, 7, 8, 9, 10, 3]
    assert pool.free_queue.block_ids() == [0, 4]
    assert_free_list_consistent(pool)


def test_shared_block_joins_free_list_only_at_last_reference() -> None:
    pool = make_pool()
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert 0 not in pool.free_queue.block_ids()
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.free_queue.block_ids()[-1] == 0
    assert_free_list_consistent(pool)


def test_touch_removes_free_cached_block_from_the_middle() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(11)
    pool.cache_full_blocks(blocks[:3], H[:3], None)
    pool.free_blocks(reversed(blocks))  # tail first: 10, 9, ..., 0
    assert pool.free_queue.block_ids() == [10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    hit = pool.get_cached_block(H[1])
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert hit.prev_free is None and hit.next_free is None
    assert pool.free_queue.block_ids() == [10, 9, 8, 7, 6, 5, 4, 3, 2, 0]
    # Touching again a referenced block only counts; the list is unchanged.
    pool.touch([hit])
    assert hit.ref_cnt == 2
    assert pool.free_queue.block_ids() == [10, 9, 8, 7, 6, 5, 4, 3, 2, 0]
    # Head and tail can leave too.
    pool.touch([pool.blocks[10], pool.blocks[0]])
    assert pool.free_queue.block_ids() == [9, 8, 7, 6, 5, 4, 3, 2]
    # The touched block stays cached (touch is a hit, not an eviction).
    assert pool.get_cached_block(H[1]) is hit and hit.block_hash == H[1]
    assert pool.take_events() == [BlockStored((H[0], H[1], H[2]), None, (0, 1, 2), BS)]
    # Freed again, it goes to the tail.
    pool.free_blocks([hit, hit])
    assert pool.free_queue.block_ids() == [9, 8, 7, 6, 5, 4, 3, 2, 1]
    assert_free_list_consistent(pool)


def test_free_queue_remove_is_o1_by_links() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    queue.append(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4, 2]
    assert len(queue) == 5
    with pytest.raises(AssertionError, match="already free"):
        queue.append(blocks[2])
    queue.remove(blocks[0])
    with pytest.raises(AssertionError, match="not in the free list"):
        queue.remove(blocks[0])
    assert [queue.popleft().block_id for _ in range(4)] == [1, 3, 4, 2]
    with pytest.raises(NoFreeBlocksError):
        queue.popleft()
    assert len(queue) == 0


def test_cache_full_blocks_emits_block_stored() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks[:2], H[:2], None)
    assert pool.take_events() == [BlockStored((H[0], H[1]), None, (0, 1), BS)]
    assert pool.cached == {H[0]: blocks[0], H[1]: blocks[1]}
    assert [b.block_hash for b in blocks] == [H[0], H[1], None]
    # Extending the chain: the parent is the previous block's hash.
    pool.cache_full_blocks(blocks[2:], H[2:3], H[1])
    assert pool.take_events() == [BlockStored((H[2],), H[1], (2,), BS)]
    assert pool.num_cached_blocks == 3
    # Naming does not change ref counts or the free list.
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_queue.block_ids() == list(range(3, 11))


def test_cache_full_blocks_does_not_rename_named_blocks() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks[:1], H[:1], None)
    pool.take_events()
    # Block 0 is already named: it is skipped, and the run of new names starts after it.
    pool.cache_full_blocks(blocks, H[:3], None)
    assert pool.take_events() == [BlockStored((H[1], H[2]), H[0], (1, 2), BS)]
    assert [b.block_hash for b in blocks] == [H[0], H[1], H[2]]
    # Naming all of them again is a no-op without events.
    pool.cache_full_blocks(blocks, H[:3], None)
    assert pool.take_events() == []
    # A named block handed a different hash keeps its name.
    pool.cache_full_blocks(blocks[:1], [H[7]], None)
    assert blocks[0].block_hash == H[0]
    assert H[7] not in pool.cached
    assert pool.take_events() == []


def test_cache_full_blocks_skips_hash_cached_elsewhere_and_splits_runs() -> None:
    pool = make_pool()
    first = pool.get_new_blocks(4)  # 0..3 computed the chain h0..h3 first
    pool.cache_full_blocks(first[1:2], H[1:2], H[0])  # only h1 is known (in block 1)
    pool.take_events()
    second = pool.get_new_blocks(4)  # 4..7 computed h0..h3 at the same time
    pool.cache_full_blocks(second, H[:4], None)
    # h1 stays in block 1; block 5 stays unnamed; two runs: [h0] and [h2, h3] under h1.
    assert pool.take_events() == [
        BlockStored((H[0],), None, (4,), BS),
        BlockStored((H[2], H[3]), H[1], (6, 7), BS),
    ]
    assert [b.block_hash for b in second] == [H[0], None, H[2], H[3]]
    assert pool.cached[H[1]] is first[1]
    assert {h: b.block_id for h, b in pool.cached.items()} == {H[0]: 4, H[1]: 1, H[2]: 6, H[3]: 7}
    # Freed, the unnamed duplicate is plain free space: reusing it evicts nothing.
    pool.free_blocks([second[1]])
    assert pool.free_queue.block_ids() == [8, 9, 10, 5]
    pool.get_new_blocks(4)
    assert pool.take_events() == []
    assert pool.cached[H[1]] is first[1]


def test_cache_full_blocks_skip_in_the_middle_of_a_later_call() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(5)
    other = pool.get_new_blocks(1)  # block 5 holds h2 already
    pool.cache_full_blocks(other, [H[2]], H[1])
    pool.take_events()
    pool.cache_full_blocks(blocks[2:5], H[2:5], H[1])
    # h2 is taken: only the run [h3, h4] is stored, under parent h2.
    assert pool.take_events() == [BlockStored((H[3], H[4]), H[2], (3, 4), BS)]


def test_cache_full_blocks_disabled() -> None:
    pool = make_pool(enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, H[:2], None)
    assert pool.cached == {}
    assert [b.block_hash for b in blocks] == [None, None]
    assert pool.take_events() == []


def test_lazy_eviction_on_reuse() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, H[:3], None)
    pool.take_events()
    pool.free_blocks(reversed(blocks))  # tail first
    # Freed cached blocks stay cached and findable.
    assert pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1, 0]
    assert pool.num_cached_blocks == 3
    assert pool.get_cached_block(H[0]) is blocks[0]
    # Taking 8 blocks uses only never-named ones: no eviction.
    plain = pool.get_new_blocks(8)
    assert ids(plain) == [3, 4, 5, 6, 7, 8, 9, 10]
    assert pool.take_events() == []
    # The next two come from the cached tail of the chain, evicted together in one event.
    evicted = pool.get_new_blocks(2)
    assert ids(evicted) == [2, 1]
    assert pool.take_events() == [BlockRemoved((H[2], H[1]))]
    assert [b.block_hash for b in evicted] == [None, None]
    assert [b.ref_cnt for b in evicted] == [1, 1]
    assert pool.cached == {H[0]: blocks[0]}
    assert pool.get_cached_block(H[1]) is None
    assert pool.free_queue.block_ids() == [0]
    # The freed-and-reused block can be named again for another hash.
    pool.cache_full_blocks(evicted[:1], [H[5]], H[4])
    assert pool.take_events() == [BlockStored((H[5],), H[4], (2,), BS)]
    assert_free_list_consistent(pool)


def test_no_free_blocks_error_leaves_pool_untouched() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(9)
    pool.cache_full_blocks(blocks[:2], H[:2], None)
    pool.free_blocks(blocks[:2])
    pool.take_events()
    assert pool.free_queue.block_ids() == [9, 10, 0, 1]
    with pytest.raises(NoFreeBlocksError, match="asked for 5 blocks, 4 free"):
        pool.get_new_blocks(5)
    # Nothing was taken or evicted by the failed call.
    assert pool.free_queue.block_ids() == [9, 10, 0, 1]
    assert pool.num_cached_blocks == 2
    assert pool.take_events() == []
    assert ids(pool.get_new_blocks(4)) == [9, 10, 0, 1]
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(1)
    assert pool.take_events() == [BlockRemoved((H[0], H[1]))]


def test_take_events_drains() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(11)
    pool.cache_full_blocks(blocks[:1], H[:1], None)
    pool.cache_full_blocks(blocks[1:2], H[1:2], H[0])
    pool.free_blocks(blocks)
    pool.get_new_blocks(11)
    events = pool.take_events()
    assert events == [
        BlockStored((H[0],), None, (0,), BS),
        BlockStored((H[1],), H[0], (1,), BS),
        BlockRemoved((H[0], H[1])),
    ]
    assert pool.take_events() == []
    assert pool.take_events() == []


def test_reset_prefix_cache_only_when_all_free() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, H[:3], None)
    pool.take_events()
    pool.free_blocks(blocks[:2])
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks == 3
    assert pool.take_events() == []
    pool.free_blocks(blocks[2:])
    order = pool.free_queue.block_ids()
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.take_events() == [AllBlocksCleared()]
    # The free list is kept as it was; reusing the old cached blocks evicts nothing now.
    assert pool.free_queue.block_ids() == order
    pool.get_new_blocks(11)
    assert pool.take_events() == []


def test_double_free_asserts() -> None:
    pool = make_pool()
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="block 0 freed twice"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.free_queue.block_ids() == list(range(1, 11)) + [0]
    # The same block twice in one call with one reference fails on the second.
    (again,) = pool.get_new_blocks(1)
    assert again.block_id == 1
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free_blocks([again, again])
    assert_free_list_consistent(pool)



def test_uncache_takes_back_the_names_of_blocks_never_written() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks[:3], H[:3], None)
    pool.take_events()
    pool.uncache(blocks[1:])  # the step that was to write blocks 1 and 2 failed
    assert pool.take_events() == [BlockRemoved((H[1], H[2]))]
    assert pool.cached == {H[0]: blocks[0]}
    assert [b.block_hash for b in blocks] == [H[0], None, None]
    pool.uncache(blocks[1:])  # nothing named any more: no event
    assert pool.take_events() == []
