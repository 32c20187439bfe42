"""Block runs and a real Mooncake transfer between two engines."""

from __future__ import annotations

import pytest
import torch

from kvmesh.transfer.mooncake_agent import MooncakeAgent, TransferError
from kvmesh.transfer.runs import BlockRun, byte_ranges, coalesce


def test_coalesce_adjacent_on_both_sides():
    assert coalesce([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [BlockRun(4, 0, 3), BlockRun(9, 3, 2)]
    assert coalesce([1, 2, 3], [7, 9, 10]) == [BlockRun(1, 7, 1), BlockRun(2, 9, 2)]
    assert coalesce([], []) == []
    with pytest.raises(ValueError):
        coalesce([1], [])


def test_byte_ranges():
    src, dst, lengths = byte_ranges([BlockRun(4, 0, 3), BlockRun(9, 3, 2)], src_base=1000, dst_base=0, block_bytes=10)
    assert (src, dst, lengths) == ([1040, 1090], [0, 30], [30, 20])


def test_pull_blocks_between_two_pools():
    block_bytes = 4096
    peer_pool = torch.arange(16 * block_bytes // 4, dtype=torch.int32)
    local_pool = torch.zeros_like(peer_pool)
    peer, local = MooncakeAgent(), MooncakeAgent()
    peer.register(peer_pool.data_ptr(), peer_pool.numel() * 4)
    local.register(local_pool.data_ptr(), local_pool.numel() * 4)
    src, dst = [3, 4, 5, 11], [0, 1, 2, 7]
    stats = local.read_blocks(
        peer.endpoint, coalesce(src, dst), peer_base=peer_pool.data_ptr(), local_base=local_pool.data_ptr(), block_bytes=block_bytes
    )
    assert stats.bytes == 4 * block_bytes and stats.ranges == 2
    per_block = block_bytes // 4
    for s, d in zip(src, dst):
        assert torch.equal(local_pool[d * per_block : (d + 1) * per_block], peer_pool[s * per_block : (s + 1) * per_block])
    assert local.bytes_read == 4 * block_bytes
    with pytest.raises(TransferError):  # beyond what the peer registered
        local.read_blocks(peer.endpoint, [BlockRun(16, 0, 1)], peer_base=peer_pool.data_ptr(), local_base=local_pool.data_ptr(), block_bytes=block_bytes)
