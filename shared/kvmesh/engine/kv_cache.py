"""The KV pool: one tensor allocated at start, one contiguous region per block.

Layout ``(num_blocks, num_layers, 2, block_size, kv_heads, head_dim)``: a block's K and V
for every layer sit together, so block ``b`` is the byte range
``[base + b * block_bytes, base + (b + 1) * block_bytes)`` and a run of adjacent blocks is a
single range a transfer engine can move at once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvmesh.engine.kv_layout import KVLayout
from kvmesh.errors import EngineConfigError

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["DTYPES", "KVCachePool", "KVLayout", "num_blocks_for_budget"]


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    count = budget_bytes // block_bytes
    if count < 1:
        raise EngineConfigError(f"a KV budget of {budget_bytes} bytes does not hold one {block_bytes}-byte block")
    return count


class KVCachePool:
    def __init__(self, layout: KVLayout, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.tensor = torch.zeros(layout.shape, dtype=DTYPES[layout.dtype], device=device)
        self._layer_views = [(self.tensor[:, layer, 0], self.tensor[:, layer, 1]) for layer in range(layout.num_layers)]
        logger.info(
            "KV pool: %d blocks of %d tokens, %.1f MiB",
            layout.num_blocks,
            layout.block_size,
            self.nbytes / 2**20,
        )

    @property
    def base_address(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each (num_blocks, block_size, kv_heads, head_dim), strided."""
        return self._layer_views[layer]

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        return self.tensor[torch.as_tensor(list(block_ids), dtype=torch.long)].clone()

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        self.tensor[torch.as_tensor(list(block_ids), dtype=torch.long)] = data.to(self.tensor.dtype)
