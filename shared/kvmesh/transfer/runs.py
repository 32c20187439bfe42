"""Coalescing block copies into as few byte ranges as possible.

A transfer costs tens of microseconds however small it is, so adjacent blocks that are
adjacent on both sides move as one range. ``layout_byte_ranges`` finds the ranges from the
two pools' published layouts (``kvmesh.transfer.layout``): one per run for block-major
pools, one per layer per run for layer-major ones, one per layer for K and one for V per run
where a pool keeps them apart; each of these for every rank of pools split across processes
(tensor parallel), rank to rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.transfer.layout import PoolLayout, matching_pieces


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


def layout_byte_ranges(
    runs: Sequence[BlockRun], *, src: PoolLayout, dst: PoolLayout
) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) copying the runs' blocks, every
    layer, from a pool laid out as ``src`` into one laid out as ``dst``; ranges adjacent on
    both sides are merged. Raises ``ValueError`` for layouts that do not match or a block
    outside either pool."""
    pieces = matching_pieces(src, dst) if src.shape_mismatch(dst) is None else None
    if pieces is None:
        raise ValueError(f"KV layouts do not match: {src.mismatch(dst)}")
    src, dst = pieces  # as they are, or both split where one keeps K and V apart
    for run in runs:
        if run.num_blocks < 1 or run.src_block < 0 or run.dst_block < 0:
            raise ValueError(f"bad block run {run}")
        if run.src_block + run.num_blocks > src.num_blocks or run.dst_block + run.num_blocks > dst.num_blocks:
            raise ValueError(f"block run {run} reaches past a pool ({src.num_blocks} and {dst.num_blocks} blocks)")
    out = _Ranges()
    for src_rank, dst_rank in zip(src.rank_offsets(), dst.rank_offsets()):  # as many on both sides (shape_mismatch)
        ranges = _Ranges()  # none merged across ranks: each rank's pool is registered on its own
        _add_ranges(ranges, runs, src, dst, src_rank, dst_rank)
        out.src += ranges.src
        out.dst += ranges.dst
        out.lengths += ranges.lengths
    return out.src, out.dst, out.lengths


def _add_ranges(out: _Ranges, runs: Sequence[BlockRun], src: PoolLayout, dst: PoolLayout, src_rank: int, dst_rank: int) -> None:
    """The runs' ranges between one rank's pool on each side (``*_rank``: its offset)."""
    if src.block_contiguous and dst.block_contiguous:
        for run in runs:
            out.add(src_rank + src.segment_address(0, run.src_block), dst_rank + dst.segment_address(0, run.dst_block), run.num_blocks * src.block_bytes)
        return
    piece = src.piece_bytes
    adjacent = src.block_stride == piece and dst.block_stride == piece  # a run is one range per plane
    for layer in range(src.num_layers):
        for part in range(src.parts):
            for run in runs:
                if adjacent:
                    out.add(
                        src_rank + src.piece_address(layer, run.src_block, part), dst_rank + dst.piece_address(layer, run.dst_block, part),
                        run.num_blocks * piece,
                    )  # fmt: skip
                    continue
                for i in range(run.num_blocks):
                    out.add(src_rank + src.piece_address(layer, run.src_block + i, part), dst_rank + dst.piece_address(layer, run.dst_block + i, part), piece)


@dataclass(slots=True)
class _Ranges:
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def add(self, src: int, dst: int, length: int) -> None:
        if self.lengths and self.src[-1] + self.lengths[-1] == src and self.dst[-1] + self.lengths[-1] == dst:
            self.lengths[-1] += length
        else:
            self.src.append(src)
            self.dst.append(dst)
            self.lengths.append(length)
