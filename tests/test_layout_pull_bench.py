"""benchmarks/layout_pull_bench.py runs end to end on a tiny pool (real Mooncake pulls, both
layouts, both landing patterns) and reports the ranges each layout needs."""

from __future__ import annotations

from benchmarks import layout_pull_bench


def test_the_benchmark_pulls_both_layouts_and_counts_their_ranges():
    result = layout_pull_bench.run(layout_pull_bench.parse_args(["--blocks", "1,2", "--rounds", "2", "--pool-blocks", "4", "--block-size", "16"]))
    rows = {(row["blocks"], row["pattern"]): row for row in result["rows"]}
    assert rows[(2, "one run")]["LBHNC"]["ranges"] == 30 and rows[(2, "one run")]["BLHNC"]["ranges"] == 1
    assert rows[(2, "scattered")]["LBHNC"]["ranges"] == 60 and rows[(2, "scattered")]["BLHNC"]["ranges"] == 2
    assert result["machine"]["cpu"] and "| 2 (32) | scattered |" in layout_pull_bench.markdown(result)
