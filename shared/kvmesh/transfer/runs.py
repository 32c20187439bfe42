"""Coalescing block copies into as few byte ranges as possible.

A transfer costs tens of microseconds however small it is, so adjacent blocks that are
adjacent on both sides move as one range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class BlockRun:
    src_block: int
    dst_block: int
    num_blocks: int


def coalesce(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[BlockRun]:
    """Runs of consecutive ids on both sides: ``src[i] -> dst[i]`` for every i."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks")
    runs: list[BlockRun] = []
    for src, dst in zip(src_blocks, dst_blocks):
        if runs:
            last = runs[-1]
            if src == last.src_block + last.num_blocks and dst == last.dst_block + last.num_blocks:
                runs[-1] = BlockRun(last.src_block, last.dst_block, last.num_blocks + 1)
                continue
        runs.append(BlockRun(src, dst, 1))
    return runs


def byte_ranges(
    runs: Sequence[BlockRun], *, src_base: int, dst_base: int, block_bytes: int
) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) for the runs."""
    src = [src_base + run.src_block * block_bytes for run in runs]
    dst = [dst_base + run.dst_block * block_bytes for run in runs]
    lengths = [run.num_blocks * block_bytes for run in runs]
    return src, dst, lengths
