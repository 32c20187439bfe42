"""The vLLM engine's face, one story on the default model, run by ``test_vllm_engine.py``
with ``.venv-vllm/bin/python`` (vLLM is not in the test's virtualenv): prints one JSON
line of what it saw.

Export a prompt's blocks, copy them (as a pull would) into blocks taken for an import,
release the export, decode from the import: the greedy tokens of a plain run. Then leave
imported requests early and release twice: the pool ends where it began.
"""

from __future__ import annotations

import asyncio
import json
import sys


async def story(model: str) -> dict:
    import torch

    from kvmesh.engine.request import SamplingParams
    from kvmesh.worker.engines import create_engine
    from kvmesh.worker.settings import MeshSettings, WorkerSettings

    settings = WorkerSettings(
        role="prefill", mesh=MeshSettings("nats://127.0.0.1:1", ("127.0.0.1:1",)), engine="vllm", model=model,
        block_size=32, kv_cache_bytes=128 * 2**20, num_threads=1,
    )  # fmt: skip
    engine = await create_engine(settings)
    seen: dict = {"free_at_start": (await engine.pool_stats()).num_free}
    try:
        prompt = [504, 3575, 282, 4649, 314] * 14  # 70 tokens: two full blocks and a part
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        seen["plain"] = [t async for out in engine.generate("plain", prompt, params) for t in out.new_token_ids]
        reset = engine.core.engine.reset_prefix_cache  # so that the import below is one
        await engine._call(reset)
        out = await engine.prefill_export("x", prompt, params)
        assert out.kv_export is not None
        seen["export"] = {"first": out.new_token_ids, "blocks": len(out.kv_export.block_ids), "tokens": out.kv_export.num_tokens}
        staged = await engine.allocate_import("y", len(prompt))
        assert staged is not None
        src, dst = torch.tensor(list(out.kv_export.block_ids)), torch.tensor(staged)

        def pull() -> None:
            for cache in engine.core.kv_caches:
                cache[dst] = cache[src]

        await engine._call(pull)
        seen["released"] = [await engine.release_export("x"), await engine.release_export("x")]
        await engine._call(reset)
        stream = engine.generate_from_import("y", prompt, out.new_token_ids[0], "y", params)
        seen["imported"] = [t async for o in stream for t in o.new_token_ids]
        for i in range(3):  # leave after one, two, three outputs
            await engine.allocate_import(f"h{i}", len(prompt))
            stream = engine.generate_from_import(f"r{i}", prompt, 504, f"h{i}", SamplingParams(max_tokens=50, ignore_eos=True))
            n = 0
            async for _ in stream:
                n += 1
                if n == i + 1:
                    break
            await stream.aclose()
        seen["release_unused"] = [await engine.allocate_import("z", 40) is not None, await engine.release_import("z"), await engine.release_import("z")]
        for _ in range(50):
            stats = await engine.pool_stats()
            if stats.num_in_use == 0:
                break
            await asyncio.sleep(0.1)
        seen["free_at_end"] = stats.num_free
        seen["in_use_at_end"] = stats.num_in_use
    finally:
        await engine.shutdown()
    return seen


if __name__ == "__main__":
    sys.stdout.write("\n" + json.dumps(asyncio.run(story(sys.argv[1]))) + "\n")
