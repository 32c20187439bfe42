"""kvmesh's engine alone, in one process, under the serving benchmark's load, optionally with
another process burning part of one core beside it (issue 12: how much of the served
mesh's gap to its engine is other processes taking a core from the engine's OpenMP team),
or with the scheduler's growth reserve on and off (``--reserve-growth``: whether admission
keeping blocks back for the running requests' growth saves the preemptions' recomputation).

The serving configuration of `benchmarks/vllm_serving_bench.py --mode bench-serve`'s c=32 row:
256 MiB of KV, 1,024 batched tokens, 64 requests of 128 random prompt tokens and 128 forced
output tokens, at most 32 in flight (a finished request lets the next one in). Prints
output tokens/s, steps, steps that scheduled nothing, and preemptions, per round; rounds
alternate without and with the burner.

    .venv/bin/python benchmarks/engine_serving_load.py --rounds 2 --burn 0.25
    .venv/bin/python benchmarks/engine_serving_load.py --rounds 3 --reserve-growth
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from datetime import datetime, UTC
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_serving_bench as vsb  # noqa: E402

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from kvmesh.engine.request import SamplingParams  # noqa: E402
from kvmesh.machine import cpu_flags, cpu_model  # noqa: E402


def burn(share: float, stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    """Busy for ``share`` of every 20 ms, asleep for the rest, until ``stop``."""
    period = 0.02
    while not stop.is_set():
        started = time.perf_counter()
        while time.perf_counter() - started < period * share:
            pass
        time.sleep(period * (1 - share))


def serve(engine: LLMEngine, requests: int, concurrency: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(100, engine.model_config.vocab_size - 100, (requests, prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    preempted_before = engine.num_preemptions
    pending = list(enumerate(prompts))
    live = steps = empty = 0
    arrived: dict[str, float] = {}  # request -> when it was added
    last: dict[str, float] = {}  # request -> when its latest token came
    ttfts: list[float] = []
    gaps: list[float] = []  # between a request's consecutive tokens
    started = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and live < concurrency:
            index, prompt = pending.pop(0)
            engine.add_request(f"s{seed}-{index}", prompt, params)
            arrived[f"s{seed}-{index}"] = time.perf_counter()
            live += 1
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        empty += engine.last_step_tokens == 0
        for out in outputs:
            if out.new_token_ids:
                previous = last.get(out.request_id)
                (gaps if previous is not None else ttfts).append(now - (previous if previous is not None else arrived[out.request_id]))
                last[out.request_id] = now
        live -= sum(out.finished for out in outputs)
    seconds = time.perf_counter() - started
    return {"output_tok_s": requests * new_tokens / seconds, "seconds": seconds, "steps": steps,
            "steps_scheduling_nothing": empty, "preemptions": engine.num_preemptions - preempted_before,
            "ttft_p50_ms": quantile_ms(ttfts, 0.5), "ttft_p99_ms": quantile_ms(ttfts, 0.99),
            "itl_p50_ms": quantile_ms(gaps, 0.5), "itl_p99_ms": quantile_ms(gaps, 0.99), "itl_max_ms": quantile_ms(gaps, 1.0)}  # fmt: skip


def quantile_ms(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (seconds), in ms, as the serving benchmark reports it."""
    return vsb._ms(vsb.percentile(values, q))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--burn", type=float, default=0.25, help="share of one core the other process takes (0: none)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reserve-growth", action="store_true", help="each round with the growth reserve on and off (no burner)")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(dtype=args.dtype, kv_cache_bytes=args.kv_cache_mib * 2**20,
                                    max_num_batched_tokens=1024, max_num_seqs=64))  # fmt: skip
    serve(engine, 4, 4, 32, 8, seed=-1)  # warm
    report = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "command": " ".join(sys.argv), "cpu": cpu_model(),
              "cpu_flags": cpu_flags(), "torch_threads": torch.get_num_threads(), "load_before": os.getloadavg(), "rounds": []}  # fmt: skip
    for r in range(args.rounds):
        if args.reserve_growth:
            for reserve in (True, False) if r % 2 == 0 else (False, True):
                engine.scheduler.config.reserve_growth = reserve  # what it learned stays, as in a server
                result = serve(engine, args.requests, args.concurrency, args.prompt_len, args.new_tokens, seed=r)
                result["reserve_growth"] = reserve
                report["rounds"].append(result)
                print(json.dumps(result), file=sys.stderr)
            continue
        for share in (0.0, args.burn) if r % 2 == 0 else (args.burn, 0.0):
            stop = multiprocessing.Event()
            burner = multiprocessing.Process(target=burn, args=(share, stop), daemon=True) if share > 0 else None
            if burner is not None:
                burner.start()
            try:
                result = serve(engine, args.requests, args.concurrency, args.prompt_len, args.new_tokens, seed=r)
            finally:
                stop.set()
                if burner is not None:
                    burner.join(timeout=5)
            result["burn"] = share
            report["rounds"].append(result)
            print(json.dumps(result), file=sys.stderr)
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
