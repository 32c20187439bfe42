"""vLLM's prefill step, max_tokens 1, random 128-token prompts, one core, in-process: kvmesh's
VllmEngine as a worker hosts it (`kvmesh`) against plain vLLM `LLMEngine` (`plain`), same args
otherwise. Run from .venv-vllm: `PYTHONPATH=shared .venv-vllm/bin/python benchmarks/vllm_prefill_step.py plain|kvmesh`."""
import asyncio
import json
import os
import random
import statistics
import sys
import time

def prompts(n, seed=5):
    rng = random.Random(seed)
    return [[rng.randrange(100, 49152 - 100) for _ in range(128)] for _ in range(n)]

def kvmesh_mode(extra_args):
    from kvmesh.settings.worker import EngineSettings
    from kvmesh.worker.vllm_engine import VllmEngine
    from kvmesh.engine.request import SamplingParams
    s = EngineSettings(name="vllm", block_size=32, kv_cache_bytes=256 * 2**20, num_threads=1, cpu_bind="0", engine_args=extra_args)
    async def run():
        engine = await VllmEngine.start(s)
        core = engine.core
        step_times = []
        orig = core.step
        def timed():
            t = time.perf_counter()
            out = orig()
            step_times.append((time.perf_counter() - t, len(out)))
            return out
        core.step = timed
        ps = prompts(14)
        times = []
        for i, p in enumerate(ps):
            t = time.perf_counter()
            await engine.prefill_export(f"r{i}", p, SamplingParams(max_tokens=128, temperature=0))
            times.append(time.perf_counter() - t)
            await engine.release_export(f"r{i}")
            await asyncio.sleep(0.3)
        await engine.shutdown()
        return times[2:], step_times
    times, steps = asyncio.run(run())
    return times, steps

def plain_mode():
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"
    os.sched_setaffinity(0, [0])
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    from kvmesh.engine.loader.default_model import resolve_model
    from kvmesh.worker.vllm_engine import default_max_model_len
    d = resolve_model(None)
    args = EngineArgs(model=str(d), dtype="float32", block_size=32, kv_cache_memory_bytes=256 * 2**20,
                      max_model_len=default_max_model_len(d, "float32", 32, 256 * 2**20), enforce_eager=True, seed=0,
                      max_num_seqs=64, max_num_batched_tokens=1024)
    engine = LLMEngine.from_engine_args(args)
    times, steps = [], []
    for i, p in enumerate(prompts(14)):
        t = time.perf_counter()
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=1, temperature=0))
        while True:
            ts = time.perf_counter()
            outs = engine.step()
            steps.append((time.perf_counter() - ts, len(outs)))
            if any(o.finished for o in outs):
                break
        times.append(time.perf_counter() - t)
        time.sleep(0.3)
    return times[2:], steps

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "plain":
        times, steps = plain_mode()
    else:
        times, steps = kvmesh_mode(sys.argv[2] if len(sys.argv) > 2 else None)
    big = [t for t, n in steps if t > 0.02]
    print(json.dumps({"mode": mode, "extra": sys.argv[2:], "prefill_p50_ms": round(1e3 * statistics.median(times), 1),
                      "prefill_min_ms": round(1e3 * min(times), 1), "big_step_p50_ms": round(1e3 * statistics.median(big), 1) if big else None,
                      "steps": len(steps)}), flush=True)
