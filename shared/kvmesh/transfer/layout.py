"""Where a worker's KV blocks lie in its pool, as data: what a worker publishes in etcd and
puts in its KV handles, what a puller computes byte ranges from, and what two pools must
share for one to read the other's blocks.

A pool holds ``num_blocks`` blocks of ``block_size`` tokens for each of ``num_layers``
layers. The K and V of one block of one layer (a *segment*) are contiguous, their elements
ordered as ``arrangement`` says (dimensions outermost first), at
``base_address + layer * layer_stride + block * block_stride``:

- kvmesh's engine is block-major: one tensor ``[blocks, layers, 2, tokens, heads, dim]``,
  so a block's segments of every layer are adjacent (``layer_stride`` is one segment,
  ``block_stride`` all of them) and a run of adjacent blocks is one byte range;
- vLLM on CPU is layer-major: one tensor per layer ``[blocks, heads, tokens, 2 * dim]``,
  all views of one storage, so ``block_stride`` is one segment, ``layer_stride`` a whole
  layer, and a run of adjacent blocks is one range per layer.

Free of torch: the router and the protocol module load it.
"""

from __future__ import annotations

from dataclasses import dataclass

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per element of each KV dtype

KVMESH_ARRANGEMENT = "kv,token,head,dim"  # kvmesh's engine: K for every token and head, then V
VLLM_CPU_ARRANGEMENT = "head,kv,token,dim"  # vLLM on CPU: per head, K for every token, then V


@dataclass(slots=True, frozen=True)
class PoolLayout:
    engine: str  # which engine laid the pool out ("kvmesh", "vllm")
    dtype: str
    block_size: int  # tokens per block
    num_blocks: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_stride: int  # bytes from a block's segment of layer l to that of layer l + 1
    block_stride: int  # bytes from block b of a layer to block b + 1 of the same layer
    arrangement: str  # the dimensions of one segment, outermost first
    base_address: int
    pool_bytes: int  # registered with the transfer engine from base_address

    def __post_init__(self) -> None:
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"KV dtype must be one of {sorted(ITEMSIZE)}, got {self.dtype!r}")
        if min(self.block_size, self.num_blocks, self.num_layers, self.num_kv_heads, self.head_dim) < 1:
            raise ValueError("a KV layout's block size, blocks, layers, heads and head dim must be positive")
        if min(self.layer_stride, self.block_stride) < self.segment_bytes:
            raise ValueError(f"strides {self.layer_stride}, {self.block_stride} are shorter than a {self.segment_bytes}-byte segment")
        if self.last_byte > self.pool_bytes:
            raise ValueError(f"the layout reaches byte {self.last_byte} of a {self.pool_bytes}-byte pool")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def segment_bytes(self) -> int:
        """K and V of one block of one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """One block's KV over every layer (what a pull of one block moves)."""
        return self.num_layers * self.segment_bytes

    @property
    def last_byte(self) -> int:
        """One past the last byte of the last segment, from the base."""
        return (self.num_layers - 1) * self.layer_stride + (self.num_blocks - 1) * self.block_stride + self.segment_bytes

    @property
    def block_contiguous(self) -> bool:
        """A block's segments of every layer form one range, and adjacent blocks adjacent ranges."""
        return self.layer_stride == self.segment_bytes and self.block_stride == self.block_bytes

    def segment_address(self, layer: int, block: int) -> int:
        return self.base_address + layer * self.layer_stride + block * self.block_stride

    def mismatch(self, other: PoolLayout) -> str | None:
        """Why blocks cannot be copied segment for segment between pools of these two
        layouts (``None``: they can; strides, bases and the engine may differ)."""
        for name in ("block_size", "dtype", "num_layers", "num_kv_heads", "head_dim", "arrangement"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name.replace('_', ' ')} {mine} vs {theirs}"
        return None

    def compatible_with(self, other: PoolLayout) -> bool:
        return self.mismatch(other) is None


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
