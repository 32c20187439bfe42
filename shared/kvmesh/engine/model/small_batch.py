"""Which linear layers keep their plain weight for the compiled small-batch kernel, and which
get a copy in AMX tiles for the AMX or the packed AVX512-BF16 kernel.

``torch.ops.kvmesh.small_linear`` (csrc/small_linear.cpp) computes a linear of the few rows
of a decode step of a few sequences. Measured on an Intel Xeon with AMX against oneDNN's
prepacked weights (docs/benchmarks.md, "Fused norms, a small-batch linear kernel and a kept
prefix gather"): bfloat16 (AVX512-BF16) 1.47x faster at one row, 1.19-1.32x at two, even at
four, slower from eight; float32 (AVX-512, or AVX2 with FMA) 1.2x faster at one to four
rows. Hence ``SMALL_ROWS``. On an AMD EPYC Zen 4 (AVX512-BF16, no AMX), once it prefetched into
L2, bfloat16 was faster than oneDNN at one to eight rows ("The small-batch linear kernel's
prefetch", "Bfloat16's small-batch rows up to eight without AMX"), but from two rows the packed
kernel below is faster still, so on a CPU without AMX bfloat16 takes it for one row only
(``small_rows``).
It reads the plain weight, which a prepacked layer otherwise drops, so keeping it costs the
weights' bytes again: it is kept for models whose copies stay within ``PLAIN_COPY_LIMIT``, and
always where nothing is copied (the output layer's plain weight, or the embedding it is tied
to, stays anyway).

On a CPU with AMX, bfloat16 inputs of more rows than that, up to ``TILE_ROWS``, go to
``torch.ops.kvmesh.amx_linear`` (csrc/amx_linear.cpp), which reads a copy of the weight
repacked into AMX tiles (``amx_pack``, the same bytes again, the output layer's included):
a decode step's linears at 32 rows in 13.5 against oneDNN's 19.9 ms, at 16 rows 11.5 against
14.7 (benchmarks/small_ops_bench.py; docs/benchmarks.md, "An AMX tile kernel for the decode
step's linears"). On a CPU without AMX that has AVX512-BF16, bfloat16 inputs of two to
``VNNI_ROWS`` rows go to ``torch.ops.kvmesh.vnni_linear`` (csrc/vnni_linear.cpp), which reads
the same tiles with vector dot products (docs/benchmarks.md, "A packed bfloat16 linear kernel
for CPUs without AMX"). The tiles come first where both copies do not fit the limit: they
serve every row count up to their kernel's last.

float32 on a CPU with AVX2 and no AVX-512 (the packed kernel in 8-float vectors) goes to the
packed kernel from one row: there, on an AMD EPYC Zen 3, it was as fast as the small-batch
kernel at one row and 1.02-1.16x it at two to six (whose sixteen 4 x 4 sums do not fit AVX2's
sixteen registers), 1.2-1.5x oneDNN at 1 to 48 rows and 1.08-1.19x at 64 to 256
(``F32_PACKED_ROWS_AVX2``; docs/benchmarks.md, "The packed float32 kernel's sums kept in
registers"); so no plain copies are kept there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.engine.model.weights import ModelWeights
from kvmesh.machine import cpu_has_amx

# Inputs of at most this many rows go to the kernel: where it was measured faster.
SMALL_ROWS = {torch.bfloat16: 2, torch.float32: 4}
# bfloat16 on a CPU without AMX: the kernel for one row, where the packed kernel was 0.85-1.09x
# as fast run to run; from two rows the packed kernel was faster in every run (1.04-1.31x at 2-4).
SMALL_ROWS_BF16_WITHOUT_AMX = 1
# bfloat16 inputs of more rows than SMALL_ROWS and at most this many go to the AMX tile kernel:
# faster than oneDNN at every row count measured up to 64, even with it from 96.
TILE_ROWS = 64
# bfloat16 on a CPU without AMX where the packed kernel's copy does not fit PLAIN_COPY_LIMIT: the
# kernel up to eight rows, where it was faster than oneDNN (docs/benchmarks.md, "Bfloat16's
# small-batch rows up to eight without AMX").
SMALL_ROWS_BF16_UNPACKED = 8
# On a CPU without AMX, bfloat16 inputs of more rows than SMALL_ROWS_BF16_WITHOUT_AMX and at most
# this many go to the packed kernel (csrc/vnni_linear.cpp): 1.2-1.8x oneDNN from 2 to 16 rows,
# 1.1-1.2x at 24 and 32, 0.99-1.10x at 48.
VNNI_ROWS = 32
# float32 inputs of more rows than SMALL_ROWS and at most this many go to the packed float32
# kernel (csrc/f32_packed_linear.cpp), on any CPU it is built for: on an AMD Zen 4, 1.2-1.9x
# oneDNN at 5-16 rows, 1.1-1.3x at 32, 1.07-1.4x at 48, 1.05-1.07x at 64 and 96.
F32_PACKED_ROWS = 48
# float32 where the packed kernel runs AVX2's 8-float vectors: it takes every row from one, up
# to F32_PACKED_ROWS_AVX2 (on an AMD EPYC Zen 3, 1.24x oneDNN at 48 rows, 1.13-1.19x at 64-128,
# 1.08x at 256; in the engine's decode step 1.18x at 64 sequences, 1.05x at 128). Past it, prefill
# chunks go to oneDNN as elsewhere.
SMALL_ROWS_F32_WITH_AVX2_PACKED = 0
F32_PACKED_ROWS_AVX2 = 256
PLAIN_COPY_LIMIT = 2**30  # bytes of weight copies (plain, tiles) kept beside the prepacked ones, at most


@dataclass(frozen=True, slots=True)
class TileKernel:
    """A kernel that reads a packed copy of the weight: ``pack`` makes the copy and ``linear``
    runs it (both in ``torch.ops.kvmesh``), for inputs of at most ``rows`` rows."""

    label: str  # for the log
    rows: int
    pack: str
    linear: str


# The tile kernels, by the SmallBatchPlan.tile_kernel naming them.
TILE_KERNELS = {
    "amx": TileKernel("AMX tiles", TILE_ROWS, "amx_pack", "amx_linear"),  # csrc/amx_linear.cpp
    # csrc/vnni_linear.cpp: the AMX tiles read by AVX512-BF16 dot products
    "vnni": TileKernel("packed weights for AVX512-BF16 dot products", VNNI_ROWS, "amx_pack", "vnni_linear"),
    "f32": TileKernel("packed weights for float32 fused multiply-adds", F32_PACKED_ROWS, "f32_pack", "f32_packed_linear"),
}


@dataclass(frozen=True, slots=True)
class SmallBatchPlan:
    layer_rows: int  # the decoder layers' linears: small_rows (0: the kernel is not used)
    lm_head_rows: int  # the output layer's
    why: str  # one line for the log
    tile_rows: int = 0  # every linear: inputs of more than its small_rows and at most this many go to tile_kernel
    tile_kernel: str = ""  # "amx", "vnni" or "f32" (TILE_KERNELS), "" with tile_rows 0


def amx_available() -> bool:
    """Is the AMX tile kernel built here, with the tile state granted (the kernels loaded)?"""
    return bool(torch.ops.kvmesh.amx_available())


def vnni_available() -> bool:
    """Is the packed AVX512-BF16 kernel built here (the kernels loaded)?"""
    return bool(torch.ops.kvmesh.vnni_linear_available())


def f32_packed_available() -> bool:
    """Is the packed float32 kernel built here (the kernels loaded)?"""
    return bool(torch.ops.kvmesh.f32_packed_linear_available())


def f32_packed_lanes() -> int:
    """The float32 lanes of the packed kernel's vectors as built here: 16 (AVX-512), 8 (AVX2), 0."""
    return int(torch.ops.kvmesh.f32_packed_linear_lanes())


def f32_packed_rows(lanes: int) -> int:
    """The most rows a float32 input may have for the packed kernel built in vectors of ``lanes``."""
    return F32_PACKED_ROWS_AVX2 if lanes == 8 else F32_PACKED_ROWS


def small_rows(dtype: torch.dtype, amx: bool, f32_packed_lanes: int = 0) -> int:
    """The most rows an input of ``dtype`` may have for the kernel; ``amx``: this CPU has AMX
    (``cpu_has_amx``: oneDNN's tiles, even where kvmesh's tile kernel was not built), where
    bfloat16 keeps the two rows measured there; ``f32_packed_lanes``: the packed float32 kernel
    is there, in vectors of so many lanes (0: it is not), which with AVX2's 8 takes every row."""
    if dtype == torch.bfloat16 and not amx:
        return SMALL_ROWS_BF16_WITHOUT_AMX
    if dtype == torch.float32 and f32_packed_lanes == 8:
        return SMALL_ROWS_F32_WITH_AVX2_PACKED
    return SMALL_ROWS[dtype]


def plan(weights: ModelWeights, dtype: torch.dtype, compiled: bool, prepacked: bool) -> SmallBatchPlan:
    """``compiled``: the kvmesh kernels are loaded; ``prepacked``: the layers drop their plain
    weights for oneDNN's copies unless told to keep them."""
    if not compiled:
        return SmallBatchPlan(0, 0, "off: the compiled kernels are not loaded")
    name = str(dtype).removeprefix("torch.")
    if dtype not in (torch.bfloat16, torch.float32):
        return SmallBatchPlan(0, 0, f"off: the kernel is for bfloat16 and float32; this engine runs {name}")
    small = torch.ops.kvmesh.small_linear_available(name)
    amx_cpu = cpu_has_amx()
    tile_kernel = ""
    if dtype == torch.bfloat16 and amx_available():
        tile_kernel = "amx"
    elif dtype == torch.bfloat16 and not amx_cpu and vnni_available():  # with AMX, oneDNN has the tiles
        tile_kernel = "vnni"
    elif dtype == torch.float32 and f32_packed_available():
        tile_kernel = "f32"
    tiles = bool(tile_kernel)
    if not small and not tiles:
        need = "AVX512-BF16" if dtype == torch.bfloat16 else "AVX-512 or AVX2 with FMA"
        return SmallBatchPlan(0, 0, f"off: {name} needs {need}, which this CPU lacks")
    # the tile kernel loaded is AMX too, whatever /proc/cpuinfo says (or fails to)
    f32_lanes = f32_packed_lanes() if tile_kernel == "f32" else 0
    rows = small_rows(dtype, tile_kernel == "amx" or amx_cpu, f32_lanes) if small else 0
    tile_limit = (f32_packed_rows(f32_lanes) if tile_kernel == "f32" else TILE_KERNELS[tile_kernel].rows) if tiles else 0
    label = TILE_KERNELS[tile_kernel].label if tiles else ""
    layers = sum(
        tensor.numel() * tensor.element_size()
        for layer in weights.layers
        for tensor in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    )
    # The output layer keeps its plain weight anyway (the embedding's, when tied): no copy.
    plain = layers if prepacked and rows else 0
    tile_copies = layers + weights.lm_head.numel() * weights.lm_head.element_size() if tiles else 0

    def small_words(rows: int) -> str:
        kept = f"keeping {plain / 2**20:.0f} MiB of plain weights beside the prepacked ones" if prepacked else "no copies"
        return f"small-batch kernel for {'one row' if rows == 1 else f'up to {rows} rows'} ({kept})"

    if plain + tile_copies <= PLAIN_COPY_LIMIT:
        tile_words = f"{label} for {rows + 1}-{tile_limit} rows ({tile_copies / 2**20:.0f} MiB)" if tiles else ""
        return SmallBatchPlan(
            rows, rows, "on: " + "; ".join(w for w in (small_words(rows) if rows else "", tile_words) if w), tile_limit, tile_kernel
        )
    if tiles and tile_copies <= PLAIN_COPY_LIMIT:
        head = ", the small-batch kernel for the output layer only" if rows else ""
        return SmallBatchPlan(
            0,
            rows,
            f"on: {label} for 1-{tile_limit} rows ({tile_copies / 2**20:.0f} MiB){head} (plain copies of the layers' "
            f"weights too would pass {PLAIN_COPY_LIMIT // 2**20} MiB)",
            tile_limit,
            tile_kernel,
        )
    too_big = f"{label} of the weights would take {tile_copies / 2**20:.0f} MiB, more than {PLAIN_COPY_LIMIT // 2**20} MiB"
    if tile_kernel == "vnni" and rows:  # no packed copy: the rows the small-batch kernel beat oneDNN at
        rows = SMALL_ROWS_BF16_UNPACKED
    if tile_kernel == "f32" and small and not rows:  # no packed copy: the small-batch kernel's rows again
        rows = SMALL_ROWS[dtype]
        plain = layers if prepacked else 0
    if rows and plain <= PLAIN_COPY_LIMIT:
        return SmallBatchPlan(rows, rows, f"on: {small_words(rows)}; no {too_big}")
    if not rows:
        return SmallBatchPlan(0, 0, f"off: {too_big}")
    return SmallBatchPlan(
        0,
        rows,
        f"on for the output layer only: copies of the layers' weights would take {(plain + tile_copies) / 2**20:.0f} MiB "
        f"(more than {PLAIN_COPY_LIMIT // 2**20} MiB)",
    )
