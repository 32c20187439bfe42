"""benchmarks/engine_thread_bench.py: both variants build a working engine and report the
token gap and throughput of batch 1 and the batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.parametrize("variant", ["pool-thread", "own-thread"])
async def test_each_variant_measures_batch_one_and_the_batch(variant, tiny_model_dir) -> None:
    import engine_thread_bench

    result = await engine_thread_bench.measure(variant, "float32", 1, batch=3, new_tokens=4, model=str(tiny_model_dir))
    assert set(result) == {"batch 1", "batch 3"}
    for figures in result.values():
        # the tiny model is fast enough for a median gap to round to 0.00 ms
        assert figures["token_gap_p50_ms"] >= 0 and figures["output_tok_s"] > 0
