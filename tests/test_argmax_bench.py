"""benchmarks/argmax_bench.py times both ways and they pick the same indices."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_both_ways_are_timed() -> None:
    import argmax_bench

    result = argmax_bench.measure(rows=3, vocab=100, repeats=2, rounds=1)
    assert result["argmax_ms"] > 0 and result["max_indices_ms"] > 0


def test_max_indices_are_argmax_with_ties_infinities_and_nan() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("-inf")] * 4, [1.0, float("nan"), 5.0, float("nan")],
                           [float("inf"), 2.0, float("inf"), 1.0]])  # fmt: skip
    assert torch.max(logits, dim=-1).indices.tolist() == torch.argmax(logits, dim=-1).tolist() == [1, 0, 1, 0]
