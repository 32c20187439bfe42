"""Where the serving path's CPU goes: `kvmesh up --prefill 0` under `vllm bench serve`
(random 128 in / 128 out) at one concurrency, with py-spy sampling the router and the decode
worker meanwhile (issue 12).

    .venv/bin/pip install py-spy==0.4.3   # not a dependency of kvmesh: a profiler, here only
    flock /tmp/kvmesh-heavy.lock .venv/bin/python benchmarks/serving_profile.py --concurrency 32 \
        --out /tmp/serving-profile

Writes, per process, py-spy's raw (collapsed) stacks and a summary of the hottest functions
by own and by inclusive samples, split by thread (the decode worker's engine thread apart
from its event loop), and the CPU seconds each process of the mesh used while measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.serving_profile
    import vllm_serving_bench as vsb
except ImportError:  # pragma: no cover - depends on how it is imported
    from benchmarks import vllm_serving_bench as vsb

logger = logging.getLogger("serving_profile")


def summarize(raw: str, top: int = 25) -> dict[str, Any]:
    """Own and inclusive sample counts by function from py-spy's raw output (one
    ``frame;frame;...;leaf count`` line per stack, the thread first with ``--threads``), by thread."""
    by_thread: dict[str, dict[str, Counter]] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread")), "-")
        frames = [f for f in frames if not f.startswith("process") and not f.startswith("thread")]
        if not frames:
            continue
        counters = by_thread.setdefault(thread, {"own": Counter(), "inclusive": Counter(), "total": Counter()})
        n = int(count)
        counters["total"]["samples"] += n
        counters["own"][_short(frames[-1])] += n
        for name in {_short(f) for f in frames}:
            counters["inclusive"][name] += n
    return {
        thread: {
            "samples": c["total"]["samples"],
            "own": c["own"].most_common(top),
            "inclusive": c["inclusive"].most_common(top),
        }
        for thread, c in by_thread.items()
    }


def _short(frame: str) -> str:
    """``function (path/to/file.py:line)`` without the line: one name per function."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    return f"{name} ({'/'.join(parts[-2:])})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompts", type=int, default=0, help="default: 2x the concurrency")
    p.add_argument("--prefill", type=int, default=0, help="kvmesh up --prefill N")
    p.add_argument("--seconds", type=float, default=20.0, help="how long py-spy samples, from 5 s into the run")
    p.add_argument("--rate", type=int, default=100)
    p.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--extra", default="", help="more `kvmesh up` flags, space-separated")
    p.add_argument("--idle", action="store_true", help="py-spy samples idle threads too (where a thread waits: the GIL, a lock, a queue)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    bench = vsb.parse_args(["--mode", "bench-serve"])
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-serving-profile-"))
    extra = ["--prefill", str(args.prefill), *args.extra.split()]
    server = vsb.start_kvmesh_up("mesh", bench, workdir, extra)
    report: dict[str, Any] = {"command": " ".join(sys.argv), "extra": extra, "concurrency": args.concurrency}
    try:
        pids = {vsb.process_label(pid): pid for pid in server.children()}
        logger.info("processes: %s", pids)
        from kvmesh.engine.loader.default_model import resolve_model

        model = vsb.served_model(server.base_url)
        prompts = args.prompts or 2 * args.concurrency
        runner = (
            "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
            "from vllm.benchmarks.serve import add_cli_args, main; "
            "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
        )
        command = [
            bench.vllm_python, "-c", runner, "--backend", "openai", "--base-url", server.base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", str(resolve_model(None)), "--dataset-name", "random",
            "--random-input-len", "128", "--random-output-len", "128", "--ignore-eos",
            "--num-prompts", str(prompts), "--max-concurrency", str(args.concurrency), "--seed", "0", "--temperature", "0",
            "--disable-tqdm", "--save-result", "--result-dir", str(workdir), "--result-filename", "result.json",
        ]  # fmt: skip
        all_pids = [server.process.pid, *server.children()]
        before = vsb.ticks_by_label(all_pids)
        started = time.monotonic()
        client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=vsb.vllm_env({}))
        time.sleep(5.0)
        spies = {}
        for label in ("router", "decode_worker"):
            if label in pids:
                out = args.out / f"{label}.raw"
                spies[label] = (out, subprocess.Popen([args.py_spy, "record", "--pid", str(pids[label]), "--duration", str(int(args.seconds)),
                                                       "--rate", str(args.rate), "--format", "raw", "--threads", "--nonblocking", "-o", str(out),
                                                       *(["--idle"] if args.idle else [])],
                                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))  # fmt: skip
        for label, (_out, spy) in spies.items():
            _, err = spy.communicate(timeout=args.seconds + 60)
            if spy.returncode != 0:
                logger.warning("py-spy on %s: %s", label, err[-500:])
        output, _ = client.communicate(timeout=1800)
        report["seconds"] = round(time.monotonic() - started, 1)
        report["cpu_seconds"] = vsb.cpu_seconds_between(before, vsb.ticks_by_label(all_pids))
        result = json.loads((workdir / "result.json").read_text())
        report["bench"] = {k: result.get(k) for k in ("completed", "failed", "output_throughput", "median_ttft_ms", "median_itl_ms", "duration")}
        for label, (out, _) in spies.items():
            if out.exists():
                report[label] = summarize(out.read_text())
        (args.out / "client.log").write_text(output)
    finally:
        server.stop()
    (args.out / "summary.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report.get(k) for k in ("bench", "cpu_seconds", "seconds")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
