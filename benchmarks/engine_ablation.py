"""Two engine optimizations, each on and off in the same run (interleaved rounds, median):

1. oneDNN-prepacked linear weights: batch-1 decode tokens/s, bfloat16 and float32.
2. Cascade attention: the decode step time of 16 sequences sharing a 2,048-token prefix.

    .venv/bin/python benchmarks/engine_ablation.py --markdown docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from datetime import datetime, UTC
from pathlib import Path

import torch

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import SamplingParams

TEXT = "The history of the river valley is long and full of stories about farmers, traders and travellers. " * 120


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def decode_rate(engine: LLMEngine, prompt: list[int], tokens: int) -> float:
    engine.add_request(f"d{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    engine.step()  # prefill and the first token
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return tokens / (time.perf_counter() - started)


def cascade_step_ms(engine: LLMEngine, prompts: list[list[int]], steps: int) -> float:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"c{time.monotonic_ns()}-{i}", prompt, SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()) or engine.scheduler.waiting:
        engine.step()  # prefill everything first
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(2)
    lines = [f"## Engine ablations ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)", "",
             f"Command: `{' '.join(sys.argv)}`  ", f"Machine: {cpu_name()}, 2 cores, torch {torch.__version__}; "
             f"median of {args.rounds} interleaved rounds", "",
             "| optimization | workload | off | on | on / off |", "|---|---|---:|---:|---:|"]
    for dtype in ("bfloat16", "float32"):
        engines = {flag: LLMEngine(EngineConfig(dtype=dtype, prepack_weights=flag, kv_cache_bytes=256 * 2**20)) for flag in (False, True)}
        prompt = engines[True].tokenizer.encode(TEXT)[:32]
        rates = {False: [], True: []}
        for _ in range(args.rounds):
            for flag, engine in engines.items():
                rates[flag].append(decode_rate(engine, prompt, args.decode_tokens))
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        lines.append(f"| prepacked linear weights | batch-1 decode, {dtype} (tokens/s) | {off:.1f} | {on:.1f} | {on / off:.2f}x |")
        del engines
        gc.collect()
    engine = LLMEngine(EngineConfig(dtype="bfloat16", kv_cache_bytes=1536 * 2**20, max_num_batched_tokens=2048))
    base = engine.tokenizer.encode(TEXT)
    prefix = base[:2048]
    times = {False: [], True: []}
    for r in range(args.rounds):
        for cascade in (False, True):
            engine.runner.cascade_min_blocks = 8 if cascade else 10**9
            prompts = [prefix + [(t + 7 * i + 31 * r + (100 if cascade else 0)) % 49000 + 100 for t in base[2100:2132]] for i in range(16)]
            times[cascade].append(cascade_step_ms(engine, prompts, 8))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    lines.append(f"| cascade attention | decode step, 16 sequences on a shared 2,048-token prefix, bfloat16 (ms) | {off:.1f} | {on:.1f} | {off / on:.2f}x faster |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.markdown:
        with args.markdown.open("a") as handle:
            handle.write("\n" + report)


if __name__ == "__main__":
    main()
