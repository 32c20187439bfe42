"""Attention on a shared prefix, each path on and off, one engine, one run.

The workload is engine_bench's shared-prefix one: N prompts of (one P-token prefix + S own
tokens), submitted at once, G new tokens each, greedy; every round uses a fresh prefix, so
the first prompt prefills it and the others hit it in the prefix cache. Two switches, each
flipped in alternating rounds (the order flips every round), median of each side:

1. ``grouped prefill`` (``ModelRunner.shared_prefill``): the prefill chunks that begin on
   the cached prefix in one step attend to it as one group (one flash attention for all
   their queries, ``SharedPrefill``) instead of one masked attention each over a gathered
   copy of prefix + own tokens. Timed: the prefill steps, and the whole workload.
2. ``flash cascade decode`` (``attention.flash_attention_with_lse``): the decode steps of
   the batch read the shared prefix in one flash attention per KV head and merge it by
   log-sum-exp with each sequence's attention to its own tokens (the compiled kernel's
   ``paged_decode_lse``, K/V read in place), instead of a matmul and a hand-written softmax
   over gathered copies of the prefix and of every sequence's own blocks. Timed: the median
   decode step. (Off also turns 1 off: the grouped prefill needs the same flash attention.)

Greedy tokens of both sides are compared (float32: identical; bfloat16 rounds the two
parts' outputs before merging them, so near-ties may flip).

    .venv/bin/python benchmarks/shared_prefix_bench.py --json docs/benchmarks-shared-prefix.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, UTC
from pathlib import Path

import torch

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.model import attention
from kvmesh.engine.request import SamplingParams
from kvmesh.machine import cpu_flags, cpu_model


@dataclass
class Shape:
    requests: int = 16
    prefix_len: int = 2048
    suffix_len: int = 32
    new_tokens: int = 16


@dataclass
class RoundTimes:
    wall_s: float
    prefill_ms: float  # the steps that prefill (the prefix, then the chunks on it)
    decode_step_ms: float  # median decode step
    outputs: list[list[int]] = field(default_factory=list)


@contextmanager
def flash_cascade(on: bool) -> Iterator[None]:
    saved = attention.flash_attention_with_lse
    if not on:
        attention.flash_attention_with_lse = None
    try:
        yield
    finally:
        attention.flash_attention_with_lse = saved


def run_round(engine: LLMEngine, shape: Shape, seed: int, tag: str) -> RoundTimes:
    """The whole workload once, on a fresh prefix; times each step."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    prefix = torch.randint(100, vocab - 100, (shape.prefix_len,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=shape.new_tokens, ignore_eos=True)
    ids = []
    for i in range(shape.requests):
        own = torch.randint(100, vocab - 100, (shape.suffix_len,), generator=gen).tolist()
        ids.append(f"{tag}-{i}")
        engine.add_request(ids[-1], prefix + own, params)
    outputs: dict[str, list[int]] = {}
    steps: list[tuple[int, float]] = []
    started = time.perf_counter()
    while engine.has_unfinished():
        step_started = time.perf_counter()
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps.append((engine.last_step_tokens, time.perf_counter() - step_started))
    wall = time.perf_counter() - started
    decode = [t for n, t in steps if n == shape.requests]
    prefill = [t for n, t in steps if n > shape.requests]
    return RoundTimes(wall, sum(prefill) * 1e3, statistics.median(decode) * 1e3, [outputs[i] for i in ids])


def measure(dtype: str, shape: Shape, rounds: int, threads: int, model: str | None = None) -> dict:
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, kv_cache_bytes=1536 * 2**20, max_num_seqs=64,
                                    max_num_batched_tokens=2048, num_threads=threads))  # fmt: skip
    run_round(engine, Shape(2, 64, 8, 2), seed=10_000, tag="warm")
    result: dict = {"dtype": dtype, "shape": shape.__dict__, "switches": {}}
    for name in ("grouped prefill", "flash cascade decode"):
        sides: dict[bool, list[RoundTimes]] = {True: [], False: []}
        for r in range(rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                if name == "grouped prefill":
                    engine.runner.shared_prefill = on
                    times = run_round(engine, shape, seed=2 * r + on, tag=f"{name}-{r}-{on}")
                    engine.runner.shared_prefill = True
                else:
                    with flash_cascade(on):
                        times = run_round(engine, shape, seed=2 * r + on, tag=f"{name}-{r}-{on}")
                sides[on].append(times)
        same = run_round_pair_equal(engine, shape, name)
        summary = {}
        for on, label in ((True, "on"), (False, "off")):
            summary[label] = {
                "wall_s": statistics.median(t.wall_s for t in sides[on]),
                "prefill_ms": statistics.median(t.prefill_ms for t in sides[on]),
                "decode_step_ms": statistics.median(t.decode_step_ms for t in sides[on]),
                "rounds": [{"wall_s": t.wall_s, "prefill_ms": t.prefill_ms, "decode_step_ms": t.decode_step_ms}
                           for t in sides[on]],  # fmt: skip
            }
        summary["greedy_identical_requests"] = same
        result["switches"][name] = summary
        print(f"{dtype} {name}: on {summary['on']['wall_s']:.2f}s (prefill {summary['on']['prefill_ms']:.0f} ms, "
              f"decode step {summary['on']['decode_step_ms']:.1f} ms), off {summary['off']['wall_s']:.2f}s "
              f"({summary['off']['prefill_ms']:.0f} ms, {summary['off']['decode_step_ms']:.1f} ms), "
              f"greedy tokens identical for {same} of {shape.requests} requests", file=sys.stderr)  # fmt: skip
    return result


def run_round_pair_equal(engine: LLMEngine, shape: Shape, name: str) -> int:
    """How many of the same prompts (same seed) get the same greedy tokens with the switch
    on and off."""
    outs = []
    for on in (True, False):
        assert engine.kv_manager.pool.reset_prefix_cache()  # both sides prefill the prefix, then hit it
        if name == "grouped prefill":
            engine.runner.shared_prefill = on
            outs.append(run_round(engine, shape, seed=999, tag=f"eq-{name}-{on}").outputs)
            engine.runner.shared_prefill = True
        else:
            with flash_cascade(on):
                outs.append(run_round(engine, shape, seed=999, tag=f"eq-{name}-{on}").outputs)
    return sum(a == b for a, b in zip(outs[0], outs[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="bfloat16 is skipped where the CPU lacks AVX512-BF16/AMX")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if attention.flash_attention_with_lse is None:
        print("this torch has no CPU flash attention with log-sum-exp: nothing to compare", file=sys.stderr)
        return 1
    flags = cpu_flags()
    dtypes = [d for d in args.dtypes.split(",") if d != "bfloat16" or "avx512_bf16" in flags or "amx" in flags]
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()
    results = [measure(d, Shape(), args.rounds, args.threads) for d in dtypes]
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
