"""The compiled small-batch linear kernel and the fused elementwise ops, per call, against
what they replace, in one run (issue 12):

1. ``torch.ops.kvmesh.small_linear`` against oneDNN's prepacked weights (``Linear`` without
   ``small_rows``) on the default model's shapes (qkv, o, gate-up, down, LM head) at 1-4 rows
   (``--rows``), each dtype, and on a CPU with AMX ``torch.ops.kvmesh.amx_linear`` (the
   weights in AMX tiles) beside them in bfloat16, with AVX512-BF16 ``torch.ops.kvmesh.vnni_linear``
   (the same tiles read by vector dot products), and in float32 ``torch.ops.kvmesh.f32_packed_linear``
   (the weight packed for fused multiply-adds); 80 weights of each shape rotated (3 of the
   LM head) so they come from memory, as in a model; the sum over a decode step's 30 layers
   and the LM head.
2. ``add_rms_norm`` against ``F.rms_norm(x + d)``, and ``silu_mul`` against
   ``F.silu(g) * u``, at 1, 16 and 2,048 rows.

    .venv/bin/python benchmarks/small_ops_bench.py --out docs/benchmarks-small-ops.json
    .venv/bin/python benchmarks/small_ops_bench.py --rows 1,2,4,8,16,32,64,128 --dtypes bfloat16 --skip-elementwise
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvmesh.engine.model import paged_kernel, small_batch
from kvmesh.engine.model.linear import Linear
from kvmesh.machine import cpu_flags, cpu_model

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30


def per_call_s(call: Callable[[], Any], repeats: int) -> float:
    for _ in range(10):
        call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats


def linear_rows(dtype: torch.dtype, rows: int) -> dict[str, Any]:
    result: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "rows": rows, "us": {}}
    amx_here = dtype == torch.bfloat16 and small_batch.amx_available()
    vnni_here = dtype == torch.bfloat16 and small_batch.vnni_available()
    f32_here = dtype == torch.float32 and small_batch.f32_packed_available()
    tiles_here = amx_here or vnni_here or f32_here
    packed_ops = {"amx_linear": amx_here, "vnni_linear": vnni_here, "f32_packed_linear": f32_here}
    step = {"onednn": 0.0, "small_linear": 0.0} | {op: 0.0 for op, here in packed_ops.items() if here}
    for name, (out_features, in_features) in SHAPES.items():
        count = 3 if name == "lm_head" else 80
        weights = [torch.randn(out_features, in_features).to(dtype) for _ in range(count)]
        packed = [Linear(w) for w in weights]
        pack = torch.ops.kvmesh.f32_pack if f32_here else torch.ops.kvmesh.amx_pack
        tiles = [pack(w) for w in weights] if tiles_here else []
        x = torch.randn(rows, in_features).to(dtype)
        packed_turns, plain_turns, tile_turns = itertools.cycle(packed), itertools.cycle(weights), itertools.cycle(tiles)

        def onednn(turns: Iterator[Linear] = packed_turns, x: torch.Tensor = x) -> torch.Tensor:
            return next(turns)(x)

        def small(turns: Iterator[torch.Tensor] = plain_turns, x: torch.Tensor = x) -> torch.Tensor:
            return torch.ops.kvmesh.small_linear(x, next(turns), None)

        repeats = 30 if name == "lm_head" else 300
        times = {"onednn": per_call_s(onednn, repeats), "small_linear": per_call_s(small, repeats)}
        for op_name, here in packed_ops.items():
            if here:
                op = getattr(torch.ops.kvmesh, op_name)

                def packed_call(op: Any = op, turns: Iterator[torch.Tensor] = tile_turns, x: torch.Tensor = x, n: int = out_features) -> torch.Tensor:
                    return op(x, next(turns), n, None)

                times[op_name] = per_call_s(packed_call, repeats)
        result["us"][name] = {k: round(v * 1e6, 1) for k, v in times.items()}
        for key, value in times.items():
            step[key] += value * (1 if name == "lm_head" else LAYERS)
    result["decode_step_linears_ms"] = {k: round(v * 1e3, 2) for k, v in step.items()}
    return result


def elementwise(dtype: torch.dtype, rows: int) -> dict[str, Any]:
    x, d, w = torch.randn(rows, 576).to(dtype), torch.randn(rows, 576).to(dtype), torch.randn(576).to(dtype)
    gate_up = torch.randn(rows, 3072).to(dtype)
    repeats = 20 if rows > 256 else 300
    times = {
        "add_rms_norm torch": per_call_s(lambda: F.rms_norm(x + d, (576,), w, 1e-5), repeats),
        "add_rms_norm fused": per_call_s(lambda: torch.ops.kvmesh.add_rms_norm(x.clone(), d, w, 1e-5), repeats),
        "silu_mul torch": per_call_s(lambda: F.silu(gate_up[:, :1536]) * gate_up[:, 1536:], repeats),
        "silu_mul fused": per_call_s(lambda: torch.ops.kvmesh.silu_mul(gate_up, 1536), repeats),
    }
    return {"dtype": str(dtype).removeprefix("torch."), "rows": rows, "us": {k: round(v * 1e6, 1) for k, v in times.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4", help="comma-separated row counts for the linears")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--skip-elementwise", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not paged_kernel.available():
        print(f"the compiled kernels are not available: {paged_kernel.last_failure}", file=sys.stderr)
        return 1
    report: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date_utc": f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S}",
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "torch": torch.__version__,
        "threads": args.threads,
        "linear": [],
        "elementwise": [],
    }
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        if torch.ops.kvmesh.small_linear_available(name):
            for rows in (int(r) for r in args.rows.split(",")):
                report["linear"].append(linear_rows(dtype, rows))
                print(json.dumps(report["linear"][-1]), flush=True)
        for rows in () if args.skip_elementwise else (1, 16, 2048):
            report["elementwise"].append(elementwise(dtype, rows))
            print(json.dumps(report["elementwise"][-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
