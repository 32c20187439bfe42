"""benchmarks/shared_prefix_bench.py times both sides of each switch and compares their tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvmesh.engine.model import attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.skipif(attention.flash_attention_with_lse is None, reason="no CPU flash attention with log-sum-exp")
def test_measure_times_both_sides_of_each_switch_and_compares_tokens(tiny_model_dir) -> None:
    import shared_prefix_bench

    shape = shared_prefix_bench.Shape(requests=3, prefix_len=160, suffix_len=8, new_tokens=3)
    result = shared_prefix_bench.measure("float32", shape, rounds=2, threads=1, model=str(tiny_model_dir))
    assert set(result["switches"]) == {"grouped prefill", "flash cascade decode"}
    for summary in result["switches"].values():
        for side in ("on", "off"):
            assert len(summary[side]["rounds"]) == 2
            assert summary[side]["wall_s"] > 0 and summary[side]["decode_step_ms"] > 0
            assert summary[side]["prefill_ms"] > 0
        assert summary["greedy_identical_requests"] == 3  # float32: the same tokens on and off
    assert attention.flash_attention_with_lse is not None  # the switch is put back
