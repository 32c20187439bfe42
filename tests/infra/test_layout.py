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
