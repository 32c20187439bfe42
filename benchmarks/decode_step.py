"""The median decode step of N concurrent sequences, for comparing two trees (kernel versions).

Two builds of the compiled kernels cannot be loaded in one process (they register the same
ops), so a before/after comparison runs this script once per tree, alternating, e.g.:

    for i in 1 2; do git stash; .venv/bin/python benchmarks/decode_step.py; git stash pop;
                     .venv/bin/python benchmarks/decode_step.py; done

Each run prints one JSON line: the commit, whether the tree had uncommitted changes, the CPU
and its flags, and the median step (ms) per dtype. ``kernel_ab_bench.py`` does the same
against an earlier commit's kernel sources without a stash (it builds them into a cache of
their own), with this script's measure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import SamplingParams
from kvmesh.machine import cpu_flags, cpu_model


def median_step_ms(dtype: str, requests: int, prompt_len: int, new_tokens: int, rounds: int,
                   threads: int, model: str | None = None) -> float:  # fmt: skip
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, kv_cache_bytes=1536 * 2**20, max_num_seqs=64,
                                    max_num_batched_tokens=2048, num_threads=threads))  # fmt: skip
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    times: list[float] = []
    for r in range(rounds):
        for i in range(requests):
            prompt = torch.randint(100, vocab - 100, (prompt_len,), generator=gen).tolist()
            engine.add_request(f"s{r}-{i}", prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        sched = engine.scheduler
        while sched.waiting or any(q.num_computed_tokens < q.num_prompt_tokens for q in sched.requests.values()):
            engine.step()
        while engine.has_unfinished():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    git = ["git", "-C", sys.path[0]]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip())
    steps = {d: median_step_ms(d, args.requests, args.prompt_len, args.new_tokens, args.rounds, args.threads)
             for d in args.dtypes.split(",")}  # fmt: skip
    print(json.dumps({"commit": commit, "uncommitted_changes": dirty, "cpu": cpu_model(), "cpu_flags": cpu_flags(),
                      "requests": args.requests, "prompt_len": args.prompt_len, "median_step_ms": steps}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
