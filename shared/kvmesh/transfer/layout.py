"""Where a worker's KV blocks lie in its pool, as data: what a worker publishes in etcd and
puts in its KV handles, what a puller computes byte ranges from, and what two pools must
share for one to read the other's blocks.

A pool holds ``num_blocks`` blocks of ``block_size`` tokens for each of ``num_layers``
layers. The K and V of one block of one layer (a *segment*) are either one contiguous
*piece*, their elements ordered as ``arrangement`` says (dimensions outermost first), or,
with ``kv_split``, two pieces, K's and V's, each ordered as ``arrangement`` says. Each layer
(each layer's K and each layer's V, when split) is a *plane*: block ``b``'s piece lies
``b * block_stride`` bytes after the plane's first. A plane's address is given one of two
ways:

- strided: ``base_address + layer * layer_stride (+ kv_stride for V)``, the pool one
  registered range of ``pool_bytes`` from ``base_address``;
- explicit: ``planes``, one address per layer (K then V per layer, when split), for pools
  whose layers are separate allocations; each plane is registered on its own.

The engines' pools:

- kvmesh's engine is block-major: one tensor ``[blocks, layers, 2, tokens, heads, dim]``,
  so a block's segments of every layer are adjacent (``layer_stride`` is one segment,
  ``block_stride`` all of them) and a run of adjacent blocks is one byte range;
- vLLM 0.32 keeps a ``[blocks, heads, tokens, 2 * dim]`` view per layer of one buffer: on CPU
  layer-major (``LBHNC``), so ``block_stride`` is one segment, ``layer_stride`` a whole
  layer, and a run of adjacent blocks is one range per layer; off CPU kvmesh's connector asks
  for layers inside blocks (``BLHNC``), block-major like kvmesh's pool;
- earlier vLLM's FlashAttention kept a tensor ``[2, blocks, tokens, heads, dim]`` per layer
  (K of every block, then V of every block), and vllm-ascend a ``(K, V)`` pair of
  ``[blocks, tokens, heads, dim]`` tensors per layer: K and V apart (``kv_split``), each
  piece ``token,head,dim``, the layers allocated one by one (``planes``).

``kvmesh.worker.kv_tensors`` reads these from the tensors.

A vLLM worker with tensor parallel ``N`` keeps its pool split by heads across vLLM's ``N``
worker processes (``ranks``), each rank's pool shared with the worker's process, which maps
them one after another, ``rank_stride`` bytes apart: the layout describes rank 0's pool
there, and rank ``r``'s lies ``r * rank_stride`` bytes further on. Blocks move between pools
split alike, rank to rank (``mismatch`` refuses pools split differently: kvmesh converts
none yet).

A pool whose segment is ``kv,<rest>`` holds the same bytes as a split pool whose pieces are
``<rest>`` with V one piece after K, so kvmesh's pool and a ``token,head,dim`` split pool pull
from each other, piece by piece.

Free of torch: the router and the protocol module load it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per element of each KV dtype

KVMESH_ARRANGEMENT = "kv,token,head,dim"  # kvmesh's engine: K for every token and head, then V
VLLM_CPU_ARRANGEMENT = "head,kv,token,dim"  # vLLM on CPU: per head, K for every token, then V
KV_FIRST = "kv,"  # an arrangement with K's piece then V's: splittable into two pieces


@dataclass(slots=True, frozen=True)
class PoolLayout:
    engine: str  # which engine laid the pool out ("kvmesh", "vllm")
    dtype: str
    block_size: int  # tokens per block
    num_blocks: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_stride: int  # strided: bytes from a block's piece of layer l to that of layer l + 1
    block_stride: int  # bytes from block b of a plane to block b + 1 of the same plane
    arrangement: str  # the dimensions of one piece, outermost first
    base_address: int
    pool_bytes: int  # every plane lies within pool_bytes from base_address (strided: registered as one)
    kv_split: bool = False  # K and V of a segment are two pieces apart
    kv_stride: int = 0  # split and strided: bytes from a block's K to its V in the same layer
    planes: tuple[int, ...] = ()  # explicit plane addresses, layer by layer (K, V per layer when split)
    ranks: int = 1  # processes the pool is split across by heads (vLLM's tensor parallel); > 1: this is rank 0's
    rank_stride: int = 0  # ranks > 1: bytes from rank r's pool to rank r + 1's, in the worker's process

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"a KV pool lies in one process or more, not {self.ranks}")
        if (self.ranks > 1) != (self.rank_stride > 0) or (self.ranks > 1 and self.rank_stride < self.pool_bytes):
            raise ValueError(f"a pool split across {self.ranks} processes needs a rank stride of a pool or more, not {self.rank_stride}")
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"KV dtype must be one of {sorted(ITEMSIZE)}, got {self.dtype!r}")
        if min(self.block_size, self.num_blocks, self.num_layers, self.num_kv_heads, self.head_dim) < 1:
            raise ValueError("a KV layout's block size, blocks, layers, heads and head dim must be positive")
        piece = self.piece_bytes
        if self.planes:
            if len(self.planes) != self.num_layers * self.parts:
                raise ValueError(f"{len(self.planes)} plane addresses for {self.num_layers} layers of {self.parts} pieces")
            strides: tuple[int, ...] = (self.block_stride,)
        else:
            strides = (self.layer_stride, self.block_stride) + ((self.kv_stride,) if self.kv_split else ())
            if not self.kv_split and self.kv_stride:
                raise ValueError("a KV stride is only for pools whose K and V lie apart")
        if min(strides) < piece:
            raise ValueError(f"strides {', '.join(map(str, strides))} are shorter than a {piece}-byte piece")
        addresses = self.plane_addresses()
        low, high = min(addresses), max(addresses) + self.plane_bytes
        if low < self.base_address or high > self.base_address + self.pool_bytes:
            raise ValueError(f"the layout reaches bytes {low - self.base_address}..{high - self.base_address} of a {self.pool_bytes}-byte pool")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def segment_bytes(self) -> int:
        """K and V of one block of one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def parts(self) -> int:
        """Pieces per segment: 2 where K and V lie apart."""
        return 2 if self.kv_split else 1

    @property
    def piece_bytes(self) -> int:
        """One contiguous piece: a whole segment, or K's or V's half of it."""
        return self.segment_bytes // self.parts

    @property
    def block_bytes(self) -> int:
        """One block's KV over every layer, in one rank's pool."""
        return self.num_layers * self.segment_bytes

    @property
    def moved_block_bytes(self) -> int:
        """What a pull of one block moves: its KV over every layer, every rank's share."""
        return self.ranks * self.block_bytes

    @property
    def plane_bytes(self) -> int:
        """From a plane's first byte to one past its last block's piece."""
        return (self.num_blocks - 1) * self.block_stride + self.piece_bytes

    @property
    def last_byte(self) -> int:
        """One past the last byte of the last piece, from the base."""
        return max(self.plane_addresses()) + self.plane_bytes - self.base_address

    @property
    def block_contiguous(self) -> bool:
        """A block's segments of every layer form one range, and adjacent blocks adjacent ranges."""
        return not self.kv_split and not self.planes and self.layer_stride == self.segment_bytes and self.block_stride == self.block_bytes

    @property
    def described(self) -> str:
        """The arrangement, and whether K and V lie apart."""
        return f"{self.arrangement} (K and V apart)" if self.kv_split else self.arrangement

    def plane_address(self, layer: int, part: int = 0) -> int:
        """Block 0's piece of ``layer`` (part 1: its V, in a split pool)."""
        if self.planes:
            return self.planes[layer * self.parts + part]
        return self.base_address + layer * self.layer_stride + part * self.kv_stride

    def plane_addresses(self) -> list[int]:
        return [self.plane_address(layer, part) for layer in range(self.num_layers) for part in range(self.parts)]

    def piece_address(self, layer: int, block: int, part: int = 0) -> int:
        return self.plane_address(layer, part) + block * self.block_stride

    def segment_address(self, layer: int, block: int) -> int:
        """Where a block's segment (its K's piece, in a split pool) of a layer begins."""
        return self.piece_address(layer, block)

    def rank_offsets(self) -> range:
        """Bytes from rank 0's pool to each rank's (one pool: ``[0]``)."""
        return range(0, self.ranks * self.rank_stride, self.rank_stride) if self.ranks > 1 else range(1)

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) to register with a transfer engine: the pool, or each explicit
        plane (overlapping and adjacent ones merged); every rank's, split across processes."""
        if self.ranks > 1:
            return [(self.base_address + offset, self.pool_bytes) for offset in self.rank_offsets()]
        if not self.planes:
            return [(self.base_address, self.pool_bytes)]
        merged: list[tuple[int, int]] = []
        for start in sorted(self.planes):
            end = start + self.plane_bytes
            if merged and start <= merged[-1][0] + merged[-1][1]:
                first, length = merged[-1]
                merged[-1] = (first, max(length, end - first))
            else:
                merged.append((start, end - start))
        return merged

    def split(self) -> PoolLayout | None:
        """The same pool as two pieces per segment (itself if it is split already; ``None``
        where K and V interleave inside a segment)."""
        if self.kv_split:
            return self
        if not self.arrangement.startswith(KV_FIRST):
            return None
        half = self.piece_bytes // 2
        planes = tuple(address + part * half for address in self.planes for part in (0, 1))
        return dataclasses.replace(
            self, arrangement=self.arrangement[len(KV_FIRST) :], kv_split=True, kv_stride=0 if planes else half, planes=planes
        )

    def mismatch(self, other: PoolLayout) -> str | None:
        """Why blocks cannot be copied piece for piece between pools of these two layouts
        (``None``: they can; strides, bases, planes and the engine may differ)."""
        shape = self.shape_mismatch(other)
        if shape is not None:
            return shape
        if matching_pieces(self, other) is None:
            return f"arrangement {self.described} vs {other.described}"
        return None

    def shape_mismatch(self, other: PoolLayout) -> str | None:
        """How the two pools' blocks differ in size or element (``mismatch`` less the order),
        or in the processes they are split across (tensor parallel)."""
        if self.ranks != other.ranks:
            return f"tensor parallel {self.ranks} vs {other.ranks} (kvmesh moves KV only between pools split alike)"
        for name in ("block_size", "dtype", "num_layers", "num_kv_heads", "head_dim"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name.replace('_', ' ')} {mine} vs {theirs}"
        return None

    def compatible_with(self, other: PoolLayout) -> bool:
        return self.mismatch(other) is None


def matching_pieces(src: PoolLayout, dst: PoolLayout) -> tuple[PoolLayout, PoolLayout] | None:
    """The two layouts cut into pieces alike (as they are, or both split), or ``None``."""
    if (src.kv_split, src.arrangement) == (dst.kv_split, dst.arrangement):
        return src, dst
    src_split, dst_split = src.split(), dst.split()
    if src_split is None or dst_split is None or src_split.arrangement != dst_split.arrangement:
        return None
    return src_split, dst_split


def block_major(
    *,
    dtype: str,
    block_size: int,
    num_blocks: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    base_address: int,
    engine: str = "kvmesh",
) -> PoolLayout:
    """kvmesh's own pool: ``[blocks, layers, 2, tokens, heads, dim]``, one tensor."""
    segment = 2 * block_size * num_kv_heads * head_dim * ITEMSIZE[dtype]
    return PoolLayout(
        engine=engine,
        dtype=dtype,
        block_size=block_size,
        num_blocks=num_blocks,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        layer_stride=segment,
        block_stride=num_layers * segment,
        arrangement=KVMESH_ARRANGEMENT,
        base_address=base_address,
        pool_bytes=num_blocks * num_layers * segment,
    )
