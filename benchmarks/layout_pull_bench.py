"""A pull's cost by pool layout: the same blocks pulled through Mooncake (tcp, loopback) from
and into vLLM 0.32-shaped pools laid out ``LBHNC`` (layer-major: one range per layer per run
of blocks, what vLLM on CPU has) and ``BLHNC`` (layers inside blocks: one range per run, what
kvmesh's connector asks vLLM for off CPU, and kvmesh's own pool's shape), rounds interleaved;
the blocks land as one run, or scattered (every other block, as a pool in use hands them out).

    .venv/bin/python benchmarks/layout_pull_bench.py --json /tmp/layout-pull.json

The pools are CPU tensors shaped as vLLM builds them (``kvmesh.worker.kv_tensors`` reads
their layouts), sized for SmolLM2-135M (30 layers, 3 KV heads of 64) in float32.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

from kvmesh.machine import cpu_flags, cpu_model
from kvmesh.transfer.layout import PoolLayout
from kvmesh.transfer.mooncake_agent import MooncakeAgent
from kvmesh.transfer.runs import coalesce, layout_byte_ranges
from kvmesh.worker.kv_tensors import pool_layout_of

logger = logging.getLogger("layout_pull_bench")

LAYERS, HEADS, DIM = 30, 3, 64
ORDERS = ("LBHNC", "BLHNC")
# where the pulled blocks land: one run of adjacent blocks, or every other block (no two adjacent)
PATTERNS = ("one run", "scattered")


def vllm_pool(order: str, num_blocks: int, block_size: int) -> tuple[torch.Tensor, PoolLayout]:
    """A flat buffer in the KVCacheLayout ``order``, and its layout read from the layer views."""
    sizes = dict(L=LAYERS, B=num_blocks, H=HEADS, N=block_size, C=2 * DIM)
    buffer = torch.randn(*(sizes[d] for d in order))
    views = list(buffer.permute(*(order.index(d) for d in "LBHNC")))
    return buffer, pool_layout_of(views, dtype="float32", block_size=block_size)


def run(args: argparse.Namespace) -> dict:
    peer, local = MooncakeAgent(), MooncakeAgent()
    pools = {}
    for order in ORDERS:
        src, src_layout = vllm_pool(order, args.pool_blocks, args.block_size)
        dst, dst_layout = vllm_pool(order, args.pool_blocks, args.block_size)
        peer.register(src.data_ptr(), src.numel() * 4)
        local.register(dst.data_ptr(), dst.numel() * 4)
        pools[order] = (src, src_layout, dst, dst_layout)
    rows = []
    for blocks, pattern in [(b, p) for b in args.blocks for p in PATTERNS]:
        if 2 * blocks > args.pool_blocks:
            raise SystemExit(f"--pool-blocks must be at least twice the largest pull ({blocks})")
        destination = range(args.pool_blocks - blocks, args.pool_blocks) if pattern == "one run" else range(0, 2 * blocks, 2)
        runs = coalesce(list(range(blocks)), list(destination))
        seconds: dict[str, list[float]] = {order: [] for order in ORDERS}
        ranges = {order: len(layout_byte_ranges(runs, src=pools[order][1], dst=pools[order][3])[0]) for order in ORDERS}
        for order in ORDERS:  # warm-up
            local.read_layout(peer.endpoint, runs, peer=pools[order][1], local=pools[order][3])
        for round_ in range(args.rounds):
            for order in ORDERS if round_ % 2 == 0 else reversed(ORDERS):
                stats = local.read_layout(peer.endpoint, runs, peer=pools[order][1], local=pools[order][3])
                seconds[order].append(stats.seconds)
        moved = blocks * pools[ORDERS[0]][1].block_bytes
        row = {"blocks": blocks, "pattern": pattern, "runs": len(runs), "tokens": blocks * args.block_size, "bytes": moved}
        for order in ORDERS:
            median = statistics.median(seconds[order])
            row[order] = {"ranges": ranges[order], "ms_median": round(median * 1e3, 3), "gbps": round(moved / median / 1e9, 2)}
        row["lbhnc_over_blhnc"] = round(row["LBHNC"]["ms_median"] / row["BLHNC"]["ms_median"], 2)
        logger.info("%s", row)
        rows.append(row)
    last = args.blocks[-1]
    for order in ORDERS:  # the pulls landed: the last one's blocks equal the source's
        src, _, dst, _ = pools[order]
        logical_src = src.permute(*(order.index(d) for d in "LBHNC"))
        logical_dst = dst.permute(*(order.index(d) for d in "LBHNC"))
        assert torch.equal(logical_dst[:, 0 : 2 * last : 2], logical_src[:, :last]), order
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": {"cpu": cpu_model(), "flags": cpu_flags(), "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "model_shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM, "dtype": "float32", "block_size": args.block_size},
        "rounds": args.rounds,
        "rows": rows,
    }


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"Command: `{result['command']}`  ",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['flags']}); torch {m['torch']}; "
        f"{result['rounds']} rounds, the two layouts interleaved with alternating order  ",
        "",
        "| blocks (tokens) | landing | bytes | LBHNC ranges | LBHNC ms (median) | BLHNC ranges | BLHNC ms (median) | LBHNC / BLHNC |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lb, bl = row["LBHNC"], row["BLHNC"]
        lines.append(
            f"| {row['blocks']} ({row['tokens']}) | {row['pattern']} | {row['bytes']:,} | {lb['ranges']} | {lb['ms_median']} | {bl['ranges']} | {bl['ms_median']} | {row['lbhnc_over_blhnc']}× |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64], help="blocks per pull (one run)")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per block (vLLM's CPU default)")
    parser.add_argument("--pool-blocks", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    sys.stdout.write(markdown(result))


if __name__ == "__main__":
    main()
