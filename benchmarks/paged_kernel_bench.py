"""The compiled decode-attention kernel on and off, one engine, one run.

Per dtype and batch size: the batch's prompts are prefilled, then decode steps are timed
with the model's ``paged_kernel`` switch on and off in alternating rounds (the order flips
each round), median step time of each side. Off is the PyTorch path (K/V blocks gathered
with ``index_select``, then matmuls); on is ``torch.ops.kvmesh.paged_decode``, which reads
K/V in place. Greedy tokens of a batch decoded both ways are compared too.

    .venv/bin/python benchmarks/paged_kernel_bench.py --json docs/benchmarks-paged-kernel.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, UTC
from pathlib import Path

import torch

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.model import paged_kernel
from kvmesh.engine.request import SamplingParams
from kvmesh.machine import cpu_flags, cpu_model


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, length), generator=gen).tolist()


def prefill_all(engine: LLMEngine, batch: list[list[int]], new_tokens: int, tag: str) -> None:
    for i, prompt in enumerate(batch):
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", prompt, params)
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        engine.step()


def step_ms(engine: LLMEngine, kernel: bool, steps: int) -> float:
    engine.model.paged_kernel = kernel
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def greedy_tokens(engine: LLMEngine, batch: list[list[int]], kernel: bool, new_tokens: int) -> list[list[int]]:
    engine.model.paged_kernel = kernel
    for i, prompt in enumerate(batch):
        engine.add_request(f"g{int(kernel)}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens[f"g{int(kernel)}-{i}"] for i in range(len(batch))]


def measure(
    dtype: str, batches: list[int], prompt_len: int, steps: int, rounds: int, threads: int, model: str | None = None
) -> dict:
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, kv_cache_bytes=1536 * 2**20, max_num_seqs=64,
                                    max_num_batched_tokens=2048, num_threads=threads, enable_prefix_caching=False))  # fmt: skip
    vocab = engine.model_config.vocab_size
    rows = []
    for batch in batches:
        on: list[float] = []
        off: list[float] = []
        for r in range(rounds):
            prefill_all(engine, prompts(batch, prompt_len, vocab, seed=r), 2 * steps + 8, f"b{batch}-r{r}")
            step_ms(engine, True, 3)  # warm both paths at this shape
            step_ms(engine, False, 3)
            order = (True, False) if r % 2 == 0 else (False, True)
            for kernel in order:
                (on if kernel else off).append(step_ms(engine, kernel, steps))
            drain(engine)
        rows.append({"batch": batch, "context": prompt_len, "on_ms": statistics.median(on), "off_ms": statistics.median(off),
                     "on_rounds": on, "off_rounds": off})  # fmt: skip
        print(
            f"{dtype} batch {batch}: kernel {statistics.median(on):.1f} ms, gather {statistics.median(off):.1f} ms",
            file=sys.stderr,
        )
    check = prompts(8, 40, vocab, seed=99)
    same = greedy_tokens(engine, check, True, 48) == greedy_tokens(engine, check, False, 48)
    return {"dtype": dtype, "rows": rows, "greedy_equal": same}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="bfloat16 is skipped where the CPU lacks AVX512-BF16/AMX")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not paged_kernel.available():
        print(f"the kernel is not available: {paged_kernel.last_failure}", file=sys.stderr)
        return 1
    flags = cpu_flags()
    dtypes = [d for d in args.dtypes.split(",") if d != "bfloat16" or "avx512_bf16" in flags or "amx" in flags]
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()
    results = [measure(d, [int(b) for b in args.batches.split(",")], args.prompt_len, args.steps, args.rounds, args.threads)
               for d in dtypes]  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"started": started, "command": " ".join([Path(sys.executable).name, *sys.argv]), "cpu": cpu_model(),
              "cpu_flags": flags, "torch": torch.__version__, "threads": args.threads, "commit": commit,
              "load_before": load, "load_after": os.getloadavg(), "results": results}  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
