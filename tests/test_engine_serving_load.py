"""benchmarks/engine_serving_load.py: the serving loop keeps at most the concurrency in flight
and finishes every request; the burner stops when told."""

from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_serve_finishes_every_request_with_a_bounded_batch(tiny_model_dir) -> None:
    import engine_serving_load

    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=64, max_num_batched_tokens=64))
    seen: list[int] = []  # requests in the engine at each step
    real_step = engine.step

    def counting_step():  # type: ignore[no-untyped-def]
        seen.append(len(engine.scheduler.running) + len(engine.scheduler.waiting))
        return real_step()

    engine.step = counting_step  # type: ignore[method-assign]
    result = engine_serving_load.serve(engine, requests=6, concurrency=2, prompt_len=5, new_tokens=4, seed=0)
    assert max(seen) <= 2 and not engine.has_unfinished()
    assert result["output_tok_s"] > 0 and result["steps"] == len(seen)
    assert engine.kv_manager.stats().num_in_use == 0


def test_the_burner_stops() -> None:
    import engine_serving_load

    stop = multiprocessing.Event()
    burner = multiprocessing.Process(target=engine_serving_load.burn, args=(0.1, stop), daemon=True)
    burner.start()
    time.sleep(0.1)
    stop.set()
    burner.join(timeout=5)
    assert not burner.is_alive()
