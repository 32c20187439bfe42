"""benchmarks/request_parse_bench.py times a request's message handling in a process per tree,
this tree against a baseline (here this tree against itself), and names the machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "request_parse_bench.py"


def test_both_trees_are_timed_for_every_measure(tmp_path) -> None:
    out = tmp_path / "parse.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--baseline-tree", str(ROOT), "--lengths", "4,40", "--rounds", "1", "--repeat", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["cpu"] and report["machine"]["flags"]
    keys = {"completion_4_ids_us", "json_loads_4_ids_us", "completion_40_ids_us", "json_loads_40_ids_us", "kv_handle_built_us", "prefill_answer_decoded_us"}
    for side in ("this tree", "baseline"):
        assert set(report["median_us"][side]) == keys
        assert all(value > 0 for value in report["median_us"][side].values())
    assert "| completion_40_ids_us |" in done.stdout
