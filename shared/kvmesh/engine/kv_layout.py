"""The shape of a KV pool, as data: what crosses the network about a pool (etcd records, KV
handles) and what two pools must share for their blocks to be copied byte for byte.
Free of torch, so the protocol module and the router do not load it."""

from __future__ import annotations

from dataclasses import dataclass

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per element of each KV dtype


@dataclass(slots=True, frozen=True)
class KVLayout:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def compatible_with(self, other: KVLayout) -> bool:
        """Blocks can be copied byte for byte between two pools of these layouts."""
        return (self.block_size, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype) == (
            other.block_size,
            other.num_layers,
            other.num_kv_heads,
            other.head_dim,
            other.dtype,
        )
