"""Layouts are data: which pools can share blocks, and the byte ranges of a pull computed
from the producer's published layout and ours."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.transfer.layout import VLLM_CPU_ARRANGEMENT, PoolLayout, block_major
from kvmesh.transfer.runs import BlockRun, coalesce, layout_byte_ranges

SEGMENT = 2 * 16 * 2 * 8 * 4  # K and V of 16 tokens, 2 heads of 8 float32s: 2 KiB


def kvmesh_pool(base: int, num_blocks: int = 8, num_layers: int = 3) -> PoolLayout:
    return block_major(
        dtype="float32", block_size=16, num_blocks=num_blocks, num_layers=num_layers, num_kv_heads=2, head_dim=8, base_address=base
    )


def layer_major_pool(base: int, num_blocks: int = 8, num_layers: int = 3, arrangement: str = VLLM_CPU_ARRANGEMENT) -> PoolLayout:
    """Like vLLM on CPU: a tensor [blocks, heads, tokens, 2 * dim] per layer, all views of one
    storage; block b of layer l at base + l * layer_stride + b * block_stride."""
    return PoolLayout(
        engine="vllm", dtype="float32", block_size=16, num_blocks=num_blocks, num_layers=num_layers, num_kv_heads=2,
        head_dim=8, layer_stride=num_blocks * SEGMENT, block_stride=SEGMENT, arrangement=arrangement,
        base_address=base, pool_bytes=num_layers * num_blocks * SEGMENT,
    )  # fmt: skip


def test_kvmesh_pools_are_block_major():
    pool = kvmesh_pool(1000)
    assert (pool.segment_bytes, pool.layer_stride, pool.block_stride, pool.block_bytes) == (SEGMENT, SEGMENT, 3 * SEGMENT, 3 * SEGMENT)
    assert pool.block_contiguous and not layer_major_pool(0).block_contiguous
    assert pool.segment_address(2, 5) == 1000 + 2 * SEGMENT + 5 * 3 * SEGMENT


def test_compatible_layouts_share_block_size_dtype_shape_and_arrangement_not_strides():
    assert kvmesh_pool(0).mismatch(kvmesh_pool(4096, num_blocks=100)) is None  # other base, other pool size
    assert layer_major_pool(0, num_blocks=8).mismatch(layer_major_pool(0, num_blocks=64)) is None  # other strides
    other_arrangement = layer_major_pool(0, arrangement="kv,token,head,dim")
    assert other_arrangement.mismatch(layer_major_pool(0)) == "arrangement kv,token,head,dim vs head,kv,token,dim"
    assert kvmesh_pool(0).mismatch(layer_major_pool(0)) == "arrangement kv,token,head,dim vs head,kv,token,dim"
    assert kvmesh_pool(0).mismatch(kvmesh_pool(0, num_layers=4)) == "num layers 3 vs 4"
    assert kvmesh_pool(0).mismatch(dataclasses.replace(kvmesh_pool(0), dtype="float16", pool_bytes=10**6)) == "dtype float32 vs float16"
    bigger_blocks = block_major(dtype="float32", block_size=32, num_blocks=8, num_layers=3, num_kv_heads=2, head_dim=8, base_address=0)
    assert kvmesh_pool(0).mismatch(bigger_blocks) == "block size 16 vs 32"
    assert not kvmesh_pool(0).compatible_with(bigger_blocks)


def test_block_major_pools_move_one_range_per_run_of_adjacent_blocks():
    src, dst = kvmesh_pool(10_000), kvmesh_pool(500_000)
    runs = coalesce([4, 5, 6, 1], [0, 1, 2, 7])
    assert layout_byte_ranges(runs, src=src, dst=dst) == (
        [10_000 + 4 * 3 * SEGMENT, 10_000 + 1 * 3 * SEGMENT],
        [500_000, 500_000 + 7 * 3 * SEGMENT],
        [3 * 3 * SEGMENT, 3 * SEGMENT],
    )


def test_layer_major_pools_move_one_range_per_layer_per_run_of_adjacent_blocks():
    src, dst = layer_major_pool(0, num_blocks=8), layer_major_pool(1 << 20, num_blocks=16)
    runs = [BlockRun(4, 0, 2), BlockRun(1, 9, 1)]  # blocks 4, 5 -> 0, 1 and block 1 -> 9
    src_addrs, dst_addrs, lengths = layout_byte_ranges(runs, src=src, dst=dst)
    assert lengths == [2 * SEGMENT, SEGMENT] * 3
    assert src_addrs == [layer * 8 * SEGMENT + block * SEGMENT for layer in range(3) for block in (4, 1)]
    assert dst_addrs == [(1 << 20) + layer * 16 * SEGMENT + block * SEGMENT for layer in range(3) for block in (0, 9)]


def test_thirty_layers_of_a_vllm_cpu_pool_are_thirty_ranges_per_run():
    src, dst = layer_major_pool(0, num_blocks=100, num_layers=30), layer_major_pool(0, num_blocks=50, num_layers=30)
    _, _, lengths = layout_byte_ranges(coalesce(list(range(10, 20)), list(range(0, 10))), src=src, dst=dst)
    assert lengths == [10 * SEGMENT] * 30


def test_a_block_major_pool_copied_into_a_layer_major_one_goes_segment_by_segment():
    src = kvmesh_pool(0)
    dst = layer_major_pool(0, arrangement=src.arrangement)  # the same segments, laid out per layer
    src_addrs, dst_addrs, lengths = layout_byte_ranges([BlockRun(2, 5, 2)], src=src, dst=dst)
    assert lengths == [SEGMENT] * 6
    assert list(zip(src_addrs, dst_addrs)) == [
        (src.segment_address(layer, 2 + i), dst.segment_address(layer, 5 + i)) for layer in range(3) for i in range(2)
    ]


def test_ranges_for_mismatched_layouts_or_blocks_outside_a_pool_are_refused():
    with pytest.raises(ValueError, match="do not match: arrangement"):
        layout_byte_ranges([BlockRun(0, 0, 1)], src=kvmesh_pool(0), dst=layer_major_pool(0))
    with pytest.raises(ValueError, match="reaches past a pool"):
        layout_byte_ranges([BlockRun(7, 0, 2)], src=kvmesh_pool(0), dst=kvmesh_pool(0))
    with pytest.raises(ValueError, match="bad block run"):
        layout_byte_ranges([BlockRun(-1, 0, 1)], src=kvmesh_pool(0), dst=kvmesh_pool(0))


def test_a_layout_must_fit_its_pool():
    with pytest.raises(ValueError, match="reaches byte"):
        dataclasses.replace(layer_major_pool(0), pool_bytes=3 * 8 * SEGMENT - 1)
    with pytest.raises(ValueError, match="shorter than"):
        dataclasses.replace(layer_major_pool(0), block_stride=SEGMENT // 2)


PIECE = SEGMENT // 2  # K (or V) of one block of one layer


def flash_attn_pool(planes: tuple[int, ...] | None = None, num_blocks: int = 8, num_layers: int = 3, arrangement: str = "token,head,dim") -> PoolLayout:
    """Like vLLM's FlashAttention on CUDA: a tensor [2, blocks, tokens, heads, dim] per layer,
    K of every block then V of every block: evenly spaced views of one storage, or the layers'
    separate allocations at ``planes`` (K, V of each layer)."""
    strided = planes is None
    return PoolLayout(
        engine="vllm", dtype="float32", block_size=16, num_blocks=num_blocks, num_layers=num_layers, num_kv_heads=2,
        head_dim=8, layer_stride=2 * num_blocks * PIECE if strided else 0, block_stride=PIECE, arrangement=arrangement,
        base_address=0 if strided else min(planes), pool_bytes=num_layers * 2 * num_blocks * PIECE if strided else max(planes) + num_blocks * PIECE - min(planes),
        kv_split=True, kv_stride=num_blocks * PIECE if strided else 0, planes=() if strided else planes,
    )  # fmt: skip


def test_a_split_pool_has_two_pieces_per_segment_and_its_v_a_kv_stride_after_its_k():
    pool = flash_attn_pool()
    assert (pool.parts, pool.piece_bytes, pool.block_bytes) == (2, PIECE, 3 * SEGMENT)
    assert pool.piece_address(2, 5, 0) == 2 * 16 * PIECE + 5 * PIECE
    assert pool.piece_address(2, 5, 1) == 2 * 16 * PIECE + 8 * PIECE + 5 * PIECE
    assert not pool.block_contiguous and pool.regions() == [(0, 3 * 16 * PIECE)]


def test_separately_allocated_layers_are_listed_plane_by_plane_and_registered_one_by_one():
    layer = 16 * PIECE  # one layer's [2, 8 blocks] tensor
    planes = (10_000, 10_000 + 8 * PIECE, 50_000, 50_000 + 8 * PIECE, 30_000, 30_000 + 8 * PIECE)
    pool = flash_attn_pool(planes)
    assert pool.piece_address(1, 3, 1) == 50_000 + 8 * PIECE + 3 * PIECE
    assert pool.regions() == [(10_000, layer), (30_000, layer), (50_000, layer)]  # K and V planes of a layer merge
    with pytest.raises(ValueError, match="plane addresses"):
        dataclasses.replace(pool, planes=planes[:4])
    with pytest.raises(ValueError, match="reaches bytes"):
        dataclasses.replace(pool, pool_bytes=pool.pool_bytes - 1)


def test_kv_first_pools_pull_piece_by_piece_from_split_pools_of_the_same_piece_order():
    kvmesh, split = kvmesh_pool(0), flash_attn_pool()
    assert kvmesh.mismatch(split) is None and split.mismatch(kvmesh) is None
    src, dst, lengths = layout_byte_ranges([BlockRun(2, 5, 2)], src=kvmesh, dst=split)
    expected = [
        (kvmesh.segment_address(layer, 2 + i) + part * PIECE, split.piece_address(layer, 5 + i, part))
        for layer in range(3) for part in (0, 1) for i in range(2)
    ]  # fmt: skip
    assert list(zip(src, dst)) == expected and lengths == [PIECE] * 12  # adjacent on neither side: piece by piece
    src_back, dst_back, _ = layout_byte_ranges([BlockRun(5, 2, 2)], src=split, dst=kvmesh)
    assert sorted(zip(dst_back, src_back)) == sorted(zip(src, dst))


def test_pools_whose_pieces_are_ordered_differently_are_refused_with_the_reason():
    nhd, hnd = flash_attn_pool(), flash_attn_pool(arrangement="head,token,dim")
    assert nhd.mismatch(hnd) == "arrangement token,head,dim (K and V apart) vs head,token,dim (K and V apart)"
    assert layer_major_pool(0).mismatch(nhd) == "arrangement head,kv,token,dim vs token,head,dim (K and V apart)"
    assert kvmesh_pool(0).mismatch(hnd) is not None
    with pytest.raises(ValueError, match="only for pools whose K and V lie apart"):
        dataclasses.replace(kvmesh_pool(0), kv_stride=PIECE)


def split_pool(base: int, ranks: int = 2, gap: int = 4096) -> PoolLayout:
    """A tensor-parallel vLLM pool as its worker maps it: each rank's pool (heads split
    between them) one after another, ``gap`` bytes apart past each."""
    one = layer_major_pool(base)
    return dataclasses.replace(one, num_kv_heads=1, ranks=ranks, rank_stride=one.pool_bytes + gap)


def test_pools_split_alike_across_processes_move_rank_to_rank():
    """Tensor parallel: block b of rank r lies r * rank_stride past rank 0's block b; a pull
    between pools split alike moves each rank's ranges into the same rank's pool."""
    src, dst = split_pool(10**6), split_pool(10**8, gap=64)
    assert src.mismatch(dst) is None
    assert src.regions() == [(10**6, src.pool_bytes), (10**6 + src.rank_stride, src.pool_bytes)]
    piece = src.piece_bytes  # one head: half a block apart (the test pool's strides are a two-head pool's)
    got = layout_byte_ranges([BlockRun(1, 3, 2)], src=src, dst=dst)
    expected = [
        (10**6 + rank * src.rank_stride + layer * src.layer_stride + (1 + i) * src.block_stride,
         10**8 + rank * dst.rank_stride + layer * dst.layer_stride + (3 + i) * dst.block_stride, piece)
        for rank in range(2) for layer in range(3) for i in range(2)
    ]  # fmt: skip
    assert list(zip(*got)) == expected
    # ranks' pools back to back (no gap): a rank's last range and the next rank's first are
    # adjacent on both sides, yet not merged (each rank's pool is registered on its own)
    one = kvmesh_pool(0)
    tight = dataclasses.replace(one, ranks=2, rank_stride=one.pool_bytes)
    last = one.num_blocks - 1
    got = layout_byte_ranges([BlockRun(0, 0, 1), BlockRun(last, last, 1)], src=tight, dst=tight)
    assert got[0] == [0, last * one.block_bytes, one.pool_bytes, one.pool_bytes + last * one.block_bytes]
    assert got[2] == [one.block_bytes] * 4 and tight.moved_block_bytes == 2 * one.block_bytes


def test_pools_split_differently_match_not_and_no_byte_range_reaches_them():
    """A pool split across 2 processes and one in one process (or split across 3) do not
    match, either way, and a pull's byte ranges between them are refused."""
    split, whole = split_pool(0), dataclasses.replace(layer_major_pool(0), num_kv_heads=1)
    assert split.mismatch(whole) == "tensor parallel 2 vs 1 (kvmesh moves KV only between pools split alike)"
    assert whole.mismatch(split) == "tensor parallel 1 vs 2 (kvmesh moves KV only between pools split alike)"
    assert split.mismatch(split_pool(0, ranks=3)) is not None
    for src, dst in ((split, whole), (whole, split)):
        with pytest.raises(ValueError, match="tensor parallel"):
            layout_byte_ranges([BlockRun(0, 0, 1)], src=src, dst=dst)
    with pytest.raises(ValueError, match="one process or more"):
        dataclasses.replace(layer_major_pool(0), ranks=0)
    with pytest.raises(ValueError, match="rank stride"):
        dataclasses.replace(layer_major_pool(0), ranks=2)  # where the other rank lies is not said
    with pytest.raises(ValueError, match="rank stride"):
        dataclasses.replace(layer_major_pool(0), ranks=2, rank_stride=64)  # ranks' pools overlap
