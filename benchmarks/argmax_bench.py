"""Greedy's row-wise argmax on CPU: ``torch.argmax(x, -1)`` against ``torch.max(x, -1).indices``
(the same indices: the first maximum, NaN counted as the maximum), interleaved, median.

    .venv/bin/python benchmarks/argmax_bench.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvmesh.machine import cpu_flags, cpu_model


def median_ms(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def measure(rows: int, vocab: int, repeats: int, rounds: int) -> dict:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.argmax(logits, -1), torch.max(logits, -1).indices)
    argmax: list[float] = []
    max_indices: list[float] = []
    for _ in range(rounds):
        argmax.append(median_ms(lambda: torch.argmax(logits, -1), repeats))
        max_indices.append(median_ms(lambda: torch.max(logits, -1).indices, repeats))
    return {"rows": rows, "vocab": vocab, "argmax_ms": statistics.median(argmax), "max_indices_ms": statistics.median(max_indices)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [measure(int(r), args.vocab, repeats=50, rounds=3) for r in args.rows.split(",")]
    print(json.dumps({"cpu": cpu_model(), "cpu_flags": cpu_flags(), "torch": torch.__version__, "threads": args.threads,
                      "results": results}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
