"""CPU an idle mesh burns: `kvmesh up` from this tree and, with ``--baseline-tree``, from
another checkout (the code before a change) up at the same time, both idle; each process's
CPU time (user + system, from /proc) over the same window, in ms of CPU a second.

    .venv/bin/python benchmarks/idle_cpu.py --baseline-tree /work/wt-base --seconds 60 \
        --json docs/benchmarks-idle-cpu.json

The baseline tree needs `.venv` and `shared/kvmesh/services` linked as
`vllm_interleaved_bench.py --baseline-tree` says.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_serving_bench as vsb  # noqa: E402
from mesh_bench import cpu_seconds  # noqa: E402

from kvmesh.machine import cpu_flags, cpu_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-tree", type=Path, help="a checkout of the code before, measured beside this tree")
    parser.add_argument("--seconds", type=float, default=60.0, help="the window CPU is counted over")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds idle before the window opens")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-idle-"))
    up_args = argparse.Namespace(kv_cache_mib=64, dtype=args.dtype, ready_timeout=300.0, vllm_python=vsb.default_vllm_python())
    sides = {"this tree": None, **({"baseline": args.baseline_tree} if args.baseline_tree else {})}
    meshes = {}
    try:
        for name, tree in sides.items():
            (workdir / name.replace(" ", "-")).mkdir()
            meshes[name] = vsb.start_kvmesh_up(name, up_args, workdir / name.replace(" ", "-"), ["--num-threads", "1"], tree=tree)
        time.sleep(args.settle)
        pids = {name: mesh.workdir / "mesh" / "pids.json" for name, mesh in meshes.items()}
        before = {name: cpu_seconds(path) for name, path in pids.items()}
        began = time.monotonic()
        time.sleep(args.seconds)
        took = time.monotonic() - began
        after = {name: cpu_seconds(path) for name, path in pids.items()}
    finally:
        for mesh in meshes.values():
            mesh.stop()
    results = {
        name: {proc: round(1000 * (after[name][proc] - before[name][proc]) / took, 2) for proc in sorted(after[name]) if proc in before[name]}
        for name in meshes
    }
    for per_process in results.values():
        per_process["all"] = round(sum(per_process.values()), 2)
    report = {
        "command": " ".join(sys.argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "flags": cpu_flags(), "python": platform.python_version()},
        "window_s": round(took, 1),
        "cpu_ms_per_s": results,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
