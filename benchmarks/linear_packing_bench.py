"""How oneDNN-prepacked weights should be packed: for 1 input row or for 32.

A weight is packed once (``kvmesh.engine.model.linear.PACK_ROWS``) and then serves batches of
every size. Two parts, in one run:

1. the model's three linear shapes (qkv 576 -> 960, gate-up 576 -> 3072, down 1536 -> 576)
   at 1, 8, 32 and 1,024 rows: GFLOP/s packed for 1 row, packed for 32, and ``F.linear``
   (best of 5 repeats);
2. two float32 engines of the default model, weights packed for 1 row and for 32, in
   interleaved rounds (the order alternating), median: batch-1 decode tokens/s (32-token
   prompt, 64 new), one decode step of 32 sequences of ~128 tokens (ms), and a 1,024-token
   prefill (ms). Greedy tokens of both engines are compared.

    .venv/bin/python benchmarks/linear_packing_bench.py --json docs/benchmarks-linear-packing.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_bench import PromptMaker, _decode_step_ms, _decode_tokens_per_s  # noqa: E402
from kvmesh.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from kvmesh.engine.model import linear  # noqa: E402
from kvmesh.engine.request import SamplingParams  # noqa: E402
from kvmesh.machine import cpu_flags, cpu_model  # noqa: E402

SHAPES = ((576, 960, "qkv"), (576, 3072, "gate-up"), (1536, 576, "down"))
ROWS = (1, 8, 32, 1024)


def gflops(call, x: torch.Tensor, flops: int) -> float:
    repeats = max(3, 2000 // x.shape[0])
    for _ in range(3):
        call(x)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeats):
            call(x)
        best = min(best, (time.perf_counter() - started) / repeats)
    return flops / best / 1e9


def linear_rates(dtype: torch.dtype) -> list[dict[str, Any]]:
    rows = []
    for k, n, name in SHAPES:
        weight = torch.randn(n, k, dtype=dtype)
        packed = {p: torch.ops.mkldnn._reorder_linear_weight(weight, p) for p in (1, 32)}
        for m in ROWS:
            x = torch.randn(m, k, dtype=dtype)
            rates = {
                f"packed for {p}": gflops(lambda x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), x, 2 * m * k * n)
                for p, w in packed.items()
            }
            rates["F.linear"] = gflops(lambda x, w=weight: F.linear(x, w), x, 2 * m * k * n)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "shape": f"{name} {k} -> {n}", "rows": m, "gflops": rates})
    return rows


def engine(pack_rows: int, kv_gib: float) -> LLMEngine:
    linear.PACK_ROWS[torch.float32] = pack_rows  # read when the weights are packed, at load
    return LLMEngine(EngineConfig(dtype="float32", kv_cache_bytes=int(kv_gib * 2**30), max_num_batched_tokens=2048))


def prefill_ms(eng: LLMEngine, prompt: list[int]) -> float:
    eng.add_request(f"p{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1))
    started = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return (time.perf_counter() - started) * 1e3


def greedy(eng: LLMEngine, prompt: list[int], tokens: int) -> list[int]:
    rid = f"g{time.monotonic_ns()}"
    eng.add_request(rid, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    out: list[int] = []
    while eng.has_unfinished():
        for o in eng.step():
            out += o.new_token_ids
    return out


def engine_rounds(rounds: int) -> dict[str, Any]:
    engines = {p: engine(p, 0.75) for p in (1, 32)}
    linear.PACK_ROWS[torch.float32] = 32
    makers = {p: PromptMaker(e.tokenizer) for p, e in engines.items()}
    for p, e in engines.items():
        _decode_tokens_per_s(e, makers[p].make(32), 4)  # warm-up
    samples: dict[str, dict[int, list[float]]] = {"batch1_tok_s": {1: [], 32: []}, "step32_ms": {1: [], 32: []}, "prefill1024_ms": {1: [], 32: []}}
    for r in range(rounds):
        order = (1, 32) if r % 2 == 0 else (32, 1)
        for p in order:
            e, make = engines[p], PromptMaker(engines[p].tokenizer)
            make.count = 1000 * r  # the same prompts for both engines in a round
            samples["batch1_tok_s"][p].append(_decode_tokens_per_s(e, make.make(32), 64))
            samples["step32_ms"][p].append(_decode_step_ms(e, [make.make(128) for _ in range(32)], 12))
            samples["prefill1024_ms"][p].append(prefill_ms(e, make.make(1024)))
    prompt = PromptMaker(engines[1].tokenizer).make(32)
    same = greedy(engines[1], prompt, 64) == greedy(engines[32], prompt, 64)
    return {"samples": samples, "medians": {k: {p: statistics.median(v) for p, v in by.items()} for k, by in samples.items()},
            "greedy_tokens_equal": same}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu": cpu_model(), "flags": cpu_flags(), "threads": args.threads, "load_average_before": os.getloadavg()},
        "torch": torch.__version__,
        "linear": [*linear_rates(torch.float32), *linear_rates(torch.bfloat16)],
        "engine_float32": engine_rounds(args.rounds),
    }
    result["machine"]["load_average_after"] = os.getloadavg()
    for row in result["linear"]:
        print(row["dtype"], row["shape"], row["rows"], {k: round(v) for k, v in row["gflops"].items()})
    print(json.dumps(result["engine_float32"]["medians"]), result["engine_float32"]["greedy_tokens_equal"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
