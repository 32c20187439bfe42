"""Which linear layers keep their plain weight for the compiled small-batch kernel.

``torch.ops.kvmesh.small_linear`` (csrc/small_linear.cpp) computes a linear of the few rows
of a decode step of a few sequences. Measured on an Intel Xeon with AMX against oneDNN's
prepacked weights (docs/benchmarks.md, "Fused norms, a small-batch linear kernel and a kept
prefix gather"): bfloat16 (AVX512-BF16) 1.47x faster at one row, 1.19-1.32x at two, even at
four, slower from eight; float32 (AVX-512, or AVX2 with FMA) 1.2x faster at one to four
rows. Hence ``SMALL_ROWS``. It reads the plain weight,
which a prepacked layer otherwise drops, so keeping it costs the weights' bytes again: it is
kept for models whose copies stay within ``PLAIN_COPY_LIMIT``, and always where nothing is
copied (the output layer's plain weight, or the embedding it is tied to, stays anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.engine.model.weights import ModelWeights

# Inputs of at most this many rows go to the kernel: where it was measured faster.
SMALL_ROWS = {torch.bfloat16: 2, torch.float32: 4}
PLAIN_COPY_LIMIT = 2**30  # bytes of plain weights kept beside the prepacked ones, at most


@dataclass(frozen=True, slots=True)
class SmallBatchPlan:
    layer_rows: int  # the decoder layers' linears: small_rows (0: the kernel is not used)
    lm_head_rows: int  # the output layer's
    why: str  # one line for the log


def plan(weights: ModelWeights, dtype: torch.dtype, compiled: bool, prepacked: bool) -> SmallBatchPlan:
    """``compiled``: the kvmesh kernels are loaded; ``prepacked``: the layers drop their plain
    weights for oneDNN's copies unless told to keep them."""
    if not compiled:
        return SmallBatchPlan(0, 0, "off: the compiled kernels are not loaded")
    name = str(dtype).removeprefix("torch.")
    if dtype not in (torch.bfloat16, torch.float32):
        return SmallBatchPlan(0, 0, f"off: the kernel is for bfloat16 and float32; this engine runs {name}")
    if not torch.ops.kvmesh.small_linear_available(name):
        need = "AVX512-BF16" if dtype == torch.bfloat16 else "AVX-512 or AVX2 with FMA"
        return SmallBatchPlan(0, 0, f"off: {name} needs {need}, which this CPU lacks")
    rows = SMALL_ROWS[dtype]
    # The output layer keeps its plain weight anyway (the embedding's, when tied): no copy.
    copies = sum(
        tensor.numel() * tensor.element_size()
        for layer in weights.layers
        for tensor in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    )
    if not prepacked or copies <= PLAIN_COPY_LIMIT:
        kept = f"keeping {copies / 2**20:.0f} MiB of plain weights beside the prepacked ones" if prepacked else "no copies"
        return SmallBatchPlan(rows, rows, f"on for steps of up to {rows} rows ({kept})")
    return SmallBatchPlan(
        0,
        rows,
        f"on for the output layer only: plain copies of the layers' weights would take {copies / 2**20:.0f} MiB "
        f"(more than {PLAIN_COPY_LIMIT // 2**20} MiB)",
    )
