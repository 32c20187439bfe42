"""The compiled CPU kernels of this tree against those of an earlier commit, in one run.

A change inside ``csrc/`` cannot be switched on and off in one process (both builds define
the same ``torch.ops.kvmesh`` operators), so each side runs in a fresh process of its own,
the sides alternating round by round (the order flips each round), the machine's drift
falling on both alike. The baseline's sources (``csrc/`` at ``--baseline``) are built with
this tree's compiler flags into a cache directory of their own, under the name this tree's
loader looks for, so that everything but the kernel library is this tree's code.

Each process measures, for each dtype:
  decode attention   ``torch.ops.kvmesh.paged_decode`` over the 30 layers of the default
                     model's shape (9 query heads, 3 KV heads of 64), ``--seqs`` sequences of
                     each ``--contexts`` length, their blocks scattered over a pool as large as
                     ``kvmesh up``'s default (256 MiB a worker; twice what the sequences take
                     where that is more), per layer strided as the engine's views are: ms for all layers, and the K/V bytes read per second;
  decode step        the default model's engine at ``--batches`` sequences of 128-token
                     prompts: the median time of a decode step (all sequences in decode);
  prefill attention  ``torch.ops.kvmesh.prefill_attention_lse`` over 30 layers of that shape for
                     each of ``--prefill-shapes`` (queries:keys:causal|all), where the side's
                     library has the kernel for the dtype (empty where not).

    .venv/bin/python benchmarks/kernel_ab_bench.py --baseline 6019319 --json docs/benchmarks-kernel-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from kvmesh.engine.model import paged_kernel
from kvmesh.machine import cpu_flags, cpu_model

CHILD_ENV = "KVMESH_KERNEL_AB_CHILD"
LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 30, 9, 3, 64, 16


def _median_ms(run: Callable[[], None], repeats: int) -> float:
    """The median of ``repeats`` timed calls of ``run``, after one untimed."""
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def attention_ms(dtype: torch.dtype, seqs: int, context: int, repeats: int) -> dict:
    """paged_decode over every layer of a pool whose blocks lie scattered."""
    gen = torch.Generator().manual_seed(context)
    pool_bytes = 256 * 2**20
    per_block = LAYERS * 2 * BLOCK * KV_HEADS * DIM * torch.tensor([], dtype=dtype).element_size()
    width = -(-context // BLOCK)
    blocks = max(pool_bytes // per_block, 2 * seqs * width)  # at least twice what the sequences take
    pool = torch.randn(blocks, LAYERS, 2, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)  # KVCachePool's layout
    tables = torch.randperm(blocks, generator=gen)[: seqs * width].view(seqs, width).contiguous()
    lens = torch.full((seqs,), context, dtype=torch.int64)
    q = torch.randn(seqs, HEADS, DIM, generator=gen).to(dtype)
    views = [(pool[:, layer, 0], pool[:, layer, 1]) for layer in range(LAYERS)]

    def all_layers() -> None:
        for k_cache, v_cache in views:
            torch.ops.kvmesh.paged_decode(q, k_cache, v_cache, tables, lens, DIM**-0.5)

    ms = _median_ms(all_layers, repeats)
    kv_bytes = seqs * context * KV_HEADS * DIM * 2 * pool.element_size() * LAYERS
    return {"seqs": seqs, "context": context, "ms": round(ms, 3), "gb_s": round(kv_bytes / ms / 1e6, 2)}


def prefill_ms(dtype: torch.dtype, shape: str, repeats: int) -> dict:
    """prefill_attention_lse over every layer: ``shape`` is queries:keys:causal (a chunk after
    keys - queries tokens of context) or queries:keys:all (a shared prefix's part of a group)."""
    queries, keys, mode = shape.split(":")
    cell: dict = {"shape": shape, "ms": None}
    if not paged_kernel.prefill_attention_built(dtype):
        return cell
    gen = torch.Generator().manual_seed(int(keys))
    q = (torch.randn(int(queries), HEADS, DIM, generator=gen) * 2).to(dtype)
    k, v = torch.randn(2, int(keys), KV_HEADS, DIM, generator=gen).to(dtype)

    def all_layers() -> None:
        for _ in range(LAYERS):
            torch.ops.kvmesh.prefill_attention_lse(q, k, v, DIM**-0.5, mode == "causal")

    cell["ms"] = round(_median_ms(all_layers, repeats), 3)
    return cell


def step_ms(dtype: str, batch: int, steps: int) -> float:
    """Median decode step of the default model's engine with ``batch`` sequences decoding
    ``steps`` tokens (decode_step.py's measure; this script runs from benchmarks/)."""
    from decode_step import median_step_ms

    return round(median_step_ms(dtype, batch, 128, steps, rounds=1, threads=torch.get_num_threads()), 3)


def child(args: argparse.Namespace) -> int:
    if not paged_kernel.available():
        print(json.dumps({"error": paged_kernel.last_failure}))
        return 1
    out: dict = {"library": str(paged_kernel.library_path()), "dtypes": {}}
    for dtype in args.dtypes:
        torch_dtype = getattr(torch, dtype)
        out["dtypes"][dtype] = {
            "attention": [attention_ms(torch_dtype, args.seqs, c, args.repeats) for c in args.contexts],
            "step_ms": {str(b): step_ms(dtype, b, args.steps) for b in args.batches},
            "prefill": [prefill_ms(torch_dtype, shape, args.repeats) for shape in args.prefill_shapes],
        }
    print(json.dumps(out))
    return 0


def build_into(cache: Path, csrc: Path) -> Path:
    """The kernel library built from ``csrc`` into ``cache``, under the name this tree's
    loader looks for there (its key is of this tree's sources)."""
    cache.mkdir(parents=True, exist_ok=True)
    built = paged_kernel.build(cache / "built", csrc=csrc)
    if built is None:
        raise SystemExit(f"building the kernel from {csrc} failed: {paged_kernel.last_failure}")
    wanted = paged_kernel.library_path(cache)
    shutil.copy(built, wanted)
    return wanted


def baseline_sources(rev: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    rel = paged_kernel.CSRC.resolve().relative_to(_repo_root())
    for name in [*paged_kernel.SOURCES, *paged_kernel.HEADERS]:
        shown = subprocess.run(["git", "show", f"{rev}:{rel / name}"], capture_output=True, cwd=_repo_root())
        if shown.returncode == 0:  # a file the baseline did not have yet is left out of its build
            (into / name).write_bytes(shown.stdout)
    return into


def _repo_root() -> Path:
    return Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip())


def run_side(args: argparse.Namespace, cache: Path) -> dict:
    env = {**os.environ, CHILD_ENV: "1", "KVMESH_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, __file__, *sys.argv[1:]], capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"a measuring process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(sides: dict[str, list[dict]], dtypes: list[str]) -> list[dict]:
    rows = []
    for dtype in dtypes:
        first = sides["tree"][0]["dtypes"][dtype]
        for i, cell in enumerate(first["attention"]):
            ms = {s: [r["dtypes"][dtype]["attention"][i]["ms"] for r in runs] for s, runs in sides.items()}
            gb = {s: [r["dtypes"][dtype]["attention"][i]["gb_s"] for r in runs] for s, runs in sides.items()}
            rows.append({"dtype": dtype, "what": f"decode attention, {cell['seqs']} x {cell['context']} tokens, 30 layers",
                         "baseline_ms": statistics.median(ms["baseline"]), "tree_ms": statistics.median(ms["tree"]),
                         "baseline_gb_s": statistics.median(gb["baseline"]), "tree_gb_s": statistics.median(gb["tree"]),
                         "baseline_rounds": ms["baseline"], "tree_rounds": ms["tree"]})  # fmt: skip
        for batch in first["step_ms"]:
            ms = {s: [r["dtypes"][dtype]["step_ms"][batch] for r in runs] for s, runs in sides.items()}
            rows.append({"dtype": dtype, "what": f"decode step, {batch} sequences",
                         "baseline_ms": statistics.median(ms["baseline"]), "tree_ms": statistics.median(ms["tree"]),
                         "baseline_rounds": ms["baseline"], "tree_rounds": ms["tree"]})  # fmt: skip
        for i, cell in enumerate(first.get("prefill", [])):
            ms = {s: [r["dtypes"][dtype]["prefill"][i]["ms"] for r in runs] for s, runs in sides.items()}
            if None in ms["baseline"] or None in ms["tree"]:  # a side without the kernel for this dtype
                continue
            rows.append({"dtype": dtype, "what": f"prefill attention, {cell['shape']}, 30 layers",
                         "baseline_ms": statistics.median(ms["baseline"]), "tree_ms": statistics.median(ms["tree"]),
                         "baseline_rounds": ms["baseline"], "tree_rounds": ms["tree"]})  # fmt: skip
    for row in rows:
        row["speedup"] = round(row["baseline_ms"] / row["tree_ms"], 3)
    return rows


def markdown(report: dict) -> str:
    lines = [
        f"Command: `{report['command']}`  ",
        f"Machine: {report['cpu']}, {os.cpu_count()} cores, flags: {report['flags_named']}; torch {report['torch']}; "
        f"this tree {report['commit']} against the kernels of {report['baseline']}; {report['rounds']} rounds, "
        "a fresh process a side a round, alternating",
        "",
        "| dtype | what | baseline (ms) | this tree (ms) | speedup | K/V read, baseline -> this tree (GB/s) |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        rate = f"{r['baseline_gb_s']:.1f} -> {r['tree_gb_s']:.1f}" if "tree_gb_s" in r else ""
        lines.append(f"| {r['dtype']} | {r['what']} | {r['baseline_ms']:.2f} | {r['tree_ms']:.2f} | {r['speedup']:.2f}x | {rate} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the commit whose csrc/ is the baseline")
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=None,
                        help="default: float32, and bfloat16 where the CPU has AVX512-BF16")  # fmt: skip
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[150, 300])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--prefill-shapes", type=lambda s: [x for x in s.split(",") if x], default=["1024:1024:causal", "512:2048:causal", "512:2048:all"],
                        help="queries:keys:causal|all for the prefill attention; '' for none")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    flags = cpu_flags()
    if args.dtypes is None:
        args.dtypes = ["float32", *(["bfloat16"] if "avx512_bf16" in flags.split() else [])]
    if os.environ.get(CHILD_ENV):
        return child(args)

    from kvmesh.engine.loader.default_model import cache_dir

    work = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
    caches = {"tree": work / "tree", "baseline": work / "baseline"}
    build_into(caches["tree"], paged_kernel.CSRC)
    build_into(caches["baseline"], baseline_sources(args.baseline, work / "baseline-csrc"))
    models = cache_dir() / "models"  # the converted default model, not converted again per side
    for cache in caches.values():
        if models.exists():
            (cache / "models").symlink_to(models)
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    load_before = os.getloadavg()
    sides: dict[str, list[dict]] = {"baseline": [], "tree": []}
    for round_index in range(args.rounds):
        order = ["baseline", "tree"] if round_index % 2 == 0 else ["tree", "baseline"]
        for side in order:
            sides[side].append(run_side(args, caches[side]))
            print(f"round {round_index + 1}: {side} done", file=sys.stderr)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "shared"], capture_output=True, text=True).stdout.strip()
    named = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "avx2") if f in flags.split()]
    report = {"started": started, "command": " ".join([Path(sys.executable).name, *sys.argv]), "cpu": cpu_model(),
              "cpu_flags": flags, "flags_named": ", ".join(named), "torch": torch.__version__,
              "commit": commit + (" (with uncommitted changes)" if dirty else ""), "baseline": args.baseline,
              "rounds": args.rounds, "load_before": load_before, "load_after": os.getloadavg(),
              "rows": summarize(sides, args.dtypes), "raw": sides}  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    text = markdown(report)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
