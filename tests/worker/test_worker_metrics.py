"""A worker's metrics as kvmesh's engine steps (the tiny model, its engine thread): tokens
counted per step while a request runs, its timings once, nothing kept after it ends,
however it ends."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine.llm_engine import EngineConfig
from kvmesh.engine.request import SamplingParams
from kvmesh.metrics.worker import WorkerMetrics
from kvmesh.worker.kvmesh_engine import KvmeshEngine


def scrape_values(text: bytes) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items()) if k in ("state", "direction"))
            values[key] = values.get(key, 0.0) + sample.value
    return values


async def test_tokens_are_counted_per_step_and_requests_forgotten(tiny_model_dir):
    engine = await KvmeshEngine.create(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=128))
    try:
        seen: list[float] = []  # the counter after each step, read on the engine thread

        class Watched(WorkerMetrics):
            def stepped(self, outputs, seconds, preemptions) -> None:
                super().stepped(outputs, seconds, preemptions)
                seen.append(self.generation_tokens._value.get())

        metrics = Watched(engine.model_name, "decode", "decode-1")
        engine.observe_steps(metrics)
        prompt = list(range(5, 17))  # 12 tokens: three full blocks
        outputs = 0
        async for _ in engine.generate("r1", prompt, SamplingParams(max_tokens=64, ignore_eos=True)):
            outputs += 1
            if outputs == 3:
                values = scrape_values(await metrics.render(engine))
                assert values["kvmesh:num_requests_running"] == 1
                assert 0 < values["kvmesh:kv_cache_usage_perc"] < 1
                assert values["kvmesh:kv_blocks,state=used"] >= 3
                assert values["kvmesh:kv_blocks_reserved_for_growth"] == 0  # nothing waits
        assert seen == list(range(1, 65))  # as each step made its token, not at the end
        values = scrape_values(await metrics.render(engine))
        blocks = [values[f"kvmesh:kv_blocks,state={state}"] for state in ("used", "cached", "free")]
        full = (12 + 64 - 1) // 4  # the request's full blocks (the last token's KV is never written)
        assert blocks == [0, full, 128 - full]  # they stay cached; the states partition the pool
        assert values["kvmesh:prompt_tokens_total"] == values["kvmesh:prefix_cache_queries_total"] == 12
        assert values["kvmesh:prefix_cache_hits_total"] == 0
        for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds",
                     "request_prefill_time_seconds", "request_decode_time_seconds"):  # fmt: skip
            assert values[f"kvmesh:{name}_count"] == 1, name
        assert values["kvmesh:inter_token_latency_seconds_count"] == 63
        assert values["kvmesh:engine_step_seconds_count"] >= 64
        assert values["kvmesh:num_requests_running"] == values["kvmesh:num_requests_waiting"] == 0
        # a decode worker's pulls waiting for room count as waiting
        assert scrape_values(await metrics.render(engine, lambda: 2))["kvmesh:num_requests_waiting"] == 2
        # The same prompt again: its full blocks are prefix hits.
        async for _ in engine.generate("r2", prompt, SamplingParams(max_tokens=2, ignore_eos=True)):
            pass
        assert scrape_values(await metrics.render(engine))["kvmesh:prefix_cache_hits_total"] == 8
        # One left early (aborted) and one refused are forgotten too.
        async for _ in engine.generate("r3", prompt, SamplingParams(max_tokens=50, ignore_eos=True)):
            break
        try:
            async for _ in engine.generate("r4", [1] * 10_000, SamplingParams(max_tokens=2)):
                pass
        except ValueError:
            pass
        await asyncio.sleep(0.2)
        assert metrics._requests == {}
    finally:
        await engine.shutdown()
