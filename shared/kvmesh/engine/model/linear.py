"""A linear layer whose weight is prepacked for oneDNN on CPU.

On the reference machine batch-1 decode runs 1.30x (bfloat16) and 1.63x (float32) faster
with prepacked weights than with ``F.linear`` on the plain tensor (benchmarks/engine_ablation.py,
docs/benchmarks.md). Elsewhere (CUDA, NPU, or a torch build without oneDNN) it is plain
``F.linear``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_PACKABLE = (torch.float32, torch.bfloat16)


def can_prepack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in _PACKABLE and torch.backends.mkldnn.is_available()


class Linear:
    """``y = x @ weight.T + bias`` for x (..., in_features)."""

    __slots__ = ("weight", "bias", "_packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, prepack: bool = True) -> None:
        self.weight: torch.Tensor | None = weight  # dropped by owners once prepacked
        self.bias = bias
        self._packed: torch.Tensor | None = None
        if prepack and can_prepack(weight):
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            except (RuntimeError, AttributeError) as exc:  # an older or unusual torch build
                logger.warning("oneDNN weight prepacking unavailable (%s); using F.linear", exc)

    @property
    def prepacked(self) -> bool:
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)
