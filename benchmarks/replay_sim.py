"""Routing policies side by side on a Mooncake-format trace, in the replay simulator.

The issue's setting: 16 prefill workers, each an LRU of 6,000 blocks of 512 tokens,
2,500 prompt tokens/s each, 6.7 ms to pull a block from a peer (a 70B model's 512-token
block over 200 Gb/s). Prints markdown tables (one per time scale) and checks the targets
for the kv-aware policy against least-load: hit rate >= 95 % of the oracle, mean TTFT
<= 0.5x, p90 TTFT <= 0.6x.

Run::

    .venv/bin/python benchmarks/replay_sim.py --trace ../shared/traces/mooncake_synthetic_trace.jsonl \
        --time-scales 1,1.5,2 [--json /tmp/replay.json]

The same figures for one time scale come from
``kvmesh replay --trace FILE --simulate --json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from kvmesh.replay import POLICIES, PolicyResult, SimConfig, TraceRequest, load_trace, oracle_hits, percentile, simulate_policies

BENCH_POLICIES = ("random", "round-robin", "least-load", "prefix-only", "kv-aware", "kv-aware-local", "weighted")


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "nproc": os.cpu_count(), "python": platform.python_version()}


def floor_ttfts(trace: list[TraceRequest], prefill_rate: float, block_size: int = 512) -> list[float]:
    """Each request alone on an idle worker with the oracle's cache (an unbounded cache
    shared for free): its uncached tokens over the rate. No policy can beat this."""
    seen: set[int] = set()
    out = []
    for r in trace:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in seen:
            k += 1
        out.append((r.input_length - min(k * block_size, r.input_length)) / prefill_rate)
        seen.update(r.hash_ids)
    return out


def table(results: list[PolicyResult]) -> str:
    rows = [
        "| policy | hit rate | % of oracle | pulled blocks | TTFT mean | p50 | p90 | p99 | max util | imbalance |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rows.append(
            f"| {r.policy} | {r.hit_rate:.1%} | {r.hit_pct_of_oracle:.1f} % | {r.pulled_blocks:,} | {r.ttft_mean:.2f} s "
            f"| {r.ttft_p50:.2f} s | {r.ttft_p90:.2f} s | {r.ttft_p99:.2f} s | {r.max_utilization:.1%} | {r.imbalance:.2f} |"
        )
    return "\n".join(rows)


def targets(results: list[PolicyResult]) -> list[tuple[str, str, bool]]:
    by_policy = {r.policy: r for r in results}
    kv, ll = by_policy.get("kv-aware"), by_policy.get("least-load")
    if kv is None or ll is None:
        return []
    return [
        ("hit rate >= 95 % of the oracle", f"{kv.hit_pct_of_oracle:.1f} %", kv.hit_pct_of_oracle >= 95.0),
        ("mean TTFT <= 0.5x least-load's", f"{kv.ttft_mean:.2f} s / {ll.ttft_mean:.2f} s = {kv.ttft_mean / ll.ttft_mean:.3f}x", kv.ttft_mean <= 0.5 * ll.ttft_mean),
        ("p90 TTFT <= 0.6x least-load's", f"{kv.ttft_p90:.2f} s / {ll.ttft_p90:.2f} s = {kv.ttft_p90 / ll.ttft_p90:.3f}x", kv.ttft_p90 <= 0.6 * ll.ttft_p90),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--cache-blocks", type=int, default=6000)
    parser.add_argument("--prefill-rate", type=float, default=2500.0)
    parser.add_argument("--pull-ms", type=float, default=6.7)
    parser.add_argument("--policies", default=",".join(BENCH_POLICIES), help=f"from {', '.join(POLICIES)}")
    parser.add_argument("--time-scales", default="1", help="comma-separated timestamp multipliers (the first is the headline)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    policies = [p for p in args.policies.split(",") if p]
    config = SimConfig(args.workers, args.cache_blocks, args.prefill_rate, args.pull_ms / 1000.0, seed=args.seed)
    digest = hashlib.sha256(Path(args.trace).read_bytes()).hexdigest()
    report: dict[str, Any] = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "trace": {"path": args.trace, "sha256": digest},
        "config": {"workers": args.workers, "cache_blocks": args.cache_blocks, "prefill_rate": args.prefill_rate, "pull_ms": args.pull_ms},
        "runs": [],
    }
    print(f"{report['date_utc']}; {report['machine']['cpu']}, {report['machine']['nproc']} cores\n")
    for scale in (float(s) for s in args.time_scales.split(",")):
        trace = load_trace(args.trace, time_scale=scale)
        blocks = sum(len(r.hash_ids) for r in trace)
        tokens = sum(r.input_length for r in trace)
        began = time.perf_counter()
        results = simulate_policies(trace, config, policies)
        elapsed = time.perf_counter() - began
        oracle = oracle_hits(trace) / blocks
        duration = trace[-1].arrival - trace[0].arrival
        # offered load: the prompt work over the cluster's prefill capacity for the trace's span
        load_cold = tokens / (args.prefill_rate * args.workers * duration)
        print(
            f"### time scale {scale:g}: {len(trace)} requests over {duration:.0f} s, oracle hit rate {oracle:.1%}, "
            f"offered load {load_cold:.0%} of capacity with no cache, {load_cold * (1 - oracle):.0%} at the oracle "
            f"(simulated {len(policies)} policies in {elapsed:.2f} s)\n"
        )
        floor = sorted(floor_ttfts(trace, args.prefill_rate))
        floor_mean = sum(floor) / len(floor)
        floor_p90 = percentile(floor, 90)
        print(table(results) + "\n")
        print(f"Floor (no queueing, oracle cache, free pulls): TTFT mean {floor_mean:.2f} s, p90 {floor_p90:.2f} s\n")
        checks = targets(results)
        for name, value, met in checks:
            print(f"- {name}: {value} -> {'met' if met else 'NOT met'}")
        print()
        report["runs"].append(
            {
                "time_scale": scale,
                "requests": len(trace),
                "duration_s": duration,
                "oracle_hit_rate": oracle,
                "floor_ttft_mean": floor_mean,
                "floor_ttft_p90": floor_p90,
                "offered_load_no_cache": load_cold,
                "simulation_s": elapsed,
                "policies": {r.policy: r.to_dict() for r in results},
                "targets": [{"target": n, "value": v, "met": m} for n, v, m in checks],
            }
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
