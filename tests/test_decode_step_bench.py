"""benchmarks/decode_step.py times decode steps of a concurrent batch."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_median_step_is_measured(tiny_model_dir) -> None:
    import decode_step

    ms = decode_step.median_step_ms("float32", requests=3, prompt_len=9, new_tokens=4, rounds=1, threads=1,
                                    model=str(tiny_model_dir))  # fmt: skip
    assert ms > 0
