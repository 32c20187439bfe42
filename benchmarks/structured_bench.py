"""What structured output costs per token: grammar-constrained vs free decoding, same run.

The default model (SmolLM2-135M-Instruct) in kvmesh's engine, in-process, ``--batch`` requests
at once (default 8), greedy, ``--new-tokens`` each. Free: plain decoding that ignores EOS, so
every request makes exactly that many tokens. Constrained: the same requests with a JSON schema
(an object holding a list of at least 100 items: it cannot end within the budget, so both make
the same number of tokens) through ``kvmesh.engine.structured`` (llguidance). Each round times
both, in alternating order; the decode time per step is the wall time of the engine steps after
the one that prefilled the batch, divided by the steps. Median of ``--rounds``.

    .venv/bin/python benchmarks/structured_bench.py --out docs/benchmarks-structured.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import SamplingParams
from kvmesh.engine.structured import GuidedDecoding
from kvmesh.machine import cpu_flags, cpu_model

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 100,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}, "ok": {"type": "boolean"}},
                "required": ["name", "qty", "ok"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> dict[str, float]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    steps: list[float] = []
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t0)
        tokens += sum(len(o.new_token_ids) for o in outs)
    total = time.perf_counter() - start
    decode = steps[1:]  # the first step prefilled the batch (and sampled its first tokens)
    return {"total_s": total, "decode_step_ms": 1e3 * statistics.mean(decode), "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(num_threads=args.threads, kv_cache_bytes=64 * 2**20, max_num_seqs=args.batch))
    tok = engine.tokenizer
    prompts = []
    for i in range(args.batch):
        text = tok.apply_chat_template([{"role": "user", "content": f"Note {i}. List items in a shop as JSON."}])
        prompts.append(tok.encode(text))
    free = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    guided = SamplingParams(max_tokens=args.new_tokens, guided=GuidedDecoding.json_schema(SCHEMA))
    run_batch(engine, prompts, free, "warm-free")
    run_batch(engine, prompts, guided, "warm-guided")
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = [("free", free), ("constrained", guided)]
        if r % 2:
            order.reverse()
        result: dict[str, Any] = {}
        for name, params in order:
            result[name] = run_batch(engine, prompts, params, f"{name}-{r}")
        rounds.append(result)
    free_ms = statistics.median(r["free"]["decode_step_ms"] for r in rounds)
    guided_ms = statistics.median(r["constrained"]["decode_step_ms"] for r in rounds)
    report = {
        "when": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "dtype": engine.config.dtype,
        "free_decode_step_ms": free_ms,
        "constrained_decode_step_ms": guided_ms,
        "free_per_token_ms": free_ms / args.batch,
        "constrained_per_token_ms": guided_ms / args.batch,
        "slowdown": guided_ms / free_ms - 1.0,
        "rounds": rounds,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
