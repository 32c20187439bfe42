"""Where the engine is loaded, and what that does to every step on the engine thread:
``AsyncEngine`` with the model loaded on asyncio's pool thread (``asyncio.to_thread``, the
code before 2841f30: that thread lives on, and so does the OpenMP pool it made) against one
loaded on a thread that ends with the loading (``kvmesh.engine.own_thread``, what
``AsyncEngine.create`` and the workers do now).

Each round starts a fresh process per variant (the order alternating from round to round);
each process builds the engine its variant's way, then streams ``--new-tokens`` forced
tokens for one request (batch 1) and for ``--batch`` requests at once, 128 random prompt
tokens each, and reports the median gap between a request's tokens and the output tokens/s.

    .venv/bin/python benchmarks/engine_thread_bench.py --rounds 3 --dtype bfloat16 \
        --out docs/benchmarks-engine-thread.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from datetime import datetime, UTC
from pathlib import Path

VARIANTS = {
    "pool-thread": "loaded with asyncio.to_thread (the code before)",
    "own-thread": "loaded on a thread that ends (AsyncEngine.create)",
}


async def measure(variant: str, dtype: str, threads: int, batch: int, new_tokens: int, model: str | None = None) -> dict:
    from kvmesh.engine.async_engine import AsyncEngine
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams

    config = EngineConfig(model=model, dtype=dtype, kv_cache_bytes=256 << 20, num_threads=threads)
    if variant == "pool-thread":
        engine = AsyncEngine(await asyncio.to_thread(LLMEngine, config))
    else:
        engine = await AsyncEngine.create(config)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)

    async def one(request_id: str) -> list[float]:
        vocab = engine.engine.model_config.vocab_size
        prompt = [rng.randrange(vocab // 10, vocab - vocab // 10) for _ in range(128)]
        times = []
        async for _ in engine.generate(request_id, prompt, params):
            times.append(time.perf_counter())
        return [b - a for a, b in zip(times, times[1:])]

    result = {}
    async with engine:
        await one("warm-up")
        for size in (1, batch):
            started = time.perf_counter()
            gaps = [g for gs in await asyncio.gather(*(one(f"b{size}-{i}") for i in range(size))) for g in gs]
            seconds = time.perf_counter() - started
            result[f"batch {size}"] = {"token_gap_p50_ms": round(1e3 * statistics.median(gaps), 2), "output_tok_s": round(size * new_tokens / seconds, 1)}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(measure(args.child, args.dtype, args.threads, args.batch, args.new_tokens))))
        return 0

    from kvmesh.machine import cpu_flags, cpu_model

    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        order = list(VARIANTS) if round_ % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            child = [sys.executable, __file__, "--child", variant, "--dtype", args.dtype, "--threads", str(args.threads),
                     "--batch", str(args.batch), "--new-tokens", str(args.new_tokens)]  # fmt: skip
            done = subprocess.run(child, capture_output=True, text=True, check=True, timeout=1800)
            runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(round_, variant, runs[variant][-1], flush=True)
    summary = {
        variant: {
            workload: {metric: statistics.median(r[workload][metric] for r in results) for metric in results[0][workload]}
            for workload in results[0]
        }
        for variant, results in runs.items()
    }
    for workload in summary["own-thread"]:
        before, after = summary["pool-thread"][workload], summary["own-thread"][workload]
        print(f"{workload}: token gap p50 {before['token_gap_p50_ms']} -> {after['token_gap_p50_ms']} ms, "
              f"output {before['output_tok_s']} -> {after['output_tok_s']} tok/s ({after['output_tok_s'] / before['output_tok_s']:.2f}x)")  # fmt: skip
    report = {
        "command": " ".join([".venv/bin/python", "benchmarks/engine_thread_bench.py", *sys.argv[1:]]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "variants": VARIANTS,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "child")},
        "median": summary,
        "rounds": runs,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
