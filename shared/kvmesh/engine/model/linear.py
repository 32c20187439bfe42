"""A linear layer whose weight is prepacked for oneDNN on CPU.

On the reference machine batch-1 decode runs 1.30x (bfloat16) and 1.63x (float32) faster
with prepacked weights than with ``F.linear`` on the plain tensor (benchmarks/engine_ablation.py,
docs/benchmarks.md). Elsewhere (CUDA, NPU, or a torch build without oneDNN) it is plain
``F.linear``.

A weight is packed once, for a number of input rows oneDNN lays it out for
(``PACK_ROWS``), and then serves every batch. float32 packed for 32 rows ran 1.2-1.9x the
rate of packed for 1 at 8 and 32 rows and no slower at 1 or 1,024 (the engine: batch-1 decode
1.19x, a 32-sequence decode step 1.18x faster); bfloat16 is as fast either way, a little
faster at 1 row packed for 1 (docs/benchmarks.md, "oneDNN weight packing").

A layer may also keep its plain weight for the compiled small-batch kernel
(``torch.ops.kvmesh.small_linear``, csrc/small_linear.cpp; which layers and how many rows:
small_batch.py): inputs of at most ``small_rows`` rows go there, where a decode step of a few
sequences is bound by reading the weight, which that kernel streams faster than oneDNN does.
A bfloat16 layer may also keep a copy of its weight in AMX tiles
(``torch.ops.kvmesh.amx_pack``, csrc/amx_linear.cpp): inputs of more than ``small_rows`` and
at most ``tile_rows`` rows go there, to the AMX kernel on a CPU with AMX, or on one without
to a kernel of AVX512-BF16 dot products that reads the same layout (csrc/vnni_linear.cpp); a
float32 layer, to a kernel of fused multiply-adds on its own packed copy
(``torch.ops.kvmesh.f32_pack``, csrc/f32_packed_linear.cpp).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvmesh.engine.model.small_batch import TILE_KERNELS

logger = logging.getLogger(__name__)

_PACKABLE = (torch.float32, torch.bfloat16)

# The input rows each dtype's weights are packed for (benchmarks/engine_ablation.py measures it).
PACK_ROWS = {torch.float32: 32, torch.bfloat16: 1}


def can_prepack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in _PACKABLE and torch.backends.mkldnn.is_available()


class Linear:
    """``y = x @ weight.T + bias`` for x (..., in_features)."""

    __slots__ = ("weight", "bias", "_packed", "small_rows", "tiles", "tile_rows", "_tile_op", "out_features")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        prepack: bool = True,
        small_rows: int = 0,
        tile_rows: int = 0,
        tile_kernel: str = "amx",
    ) -> None:
        self.weight: torch.Tensor | None = weight  # dropped by owners once prepacked, unless small_rows
        self.bias = bias
        self.out_features = weight.shape[0]
        self.small_rows = small_rows  # inputs of at most this many rows go to the small-batch kernel
        # the weight packed for tile_kernel (small_batch.TILE_KERNELS), for inputs of more than
        # small_rows and at most tile_rows rows
        self.tiles: torch.Tensor | None = None
        self._tile_op = None
        if tile_rows:
            kernel = TILE_KERNELS[tile_kernel]
            self.tiles = getattr(torch.ops.kvmesh, kernel.pack)(weight)
            self._tile_op = getattr(torch.ops.kvmesh, kernel.linear)
        self.tile_rows = tile_rows
        self._packed: torch.Tensor | None = None
        if prepack and can_prepack(weight):
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS[weight.dtype])
            except (RuntimeError, AttributeError) as exc:  # an older or unusual torch build
                logger.warning("oneDNN weight prepacking unavailable (%s); using F.linear", exc)

    @property
    def prepacked(self) -> bool:
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.small_rows:
            return torch.ops.kvmesh.small_linear(x, self.weight, self.bias)
        if rows <= self.tile_rows:
            assert self._tile_op is not None
            return self._tile_op(x, self.tiles, self.out_features, self.bias)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)
