"""benchmarks/paged_kernel_bench.py measures both sides and compares their greedy tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvmesh.engine.model import paged_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.skipif(paged_kernel.compiler() is None, reason="no C++ compiler: no kernel to compare")
def test_measure_times_both_sides_and_compares_tokens(tiny_model_dir) -> None:
    import paged_kernel_bench

    result = paged_kernel_bench.measure("float32", [1, 3], prompt_len=9, steps=2, rounds=2, threads=1, model=str(tiny_model_dir))
    assert result["dtype"] == "float32" and [row["batch"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert len(row["on_rounds"]) == len(row["off_rounds"]) == 2
        assert row["on_ms"] > 0 and row["off_ms"] > 0
    assert result["greedy_equal"] is True  # float32: the kernel and the gather path agree token for token
