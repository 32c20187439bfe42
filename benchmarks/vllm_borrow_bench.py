"""A vLLM prefill worker's prefill of a prompt whose prefix it borrowed from a peer: the
pulled blocks used where the pull put them (named in vLLM's prefix cache) against the way
before, loaded through the connector (copied into the blocks vLLM's scheduler allocated, one
step later), side by side in one process, rounds interleaved (issue 9).

The peer's pull is stood in for by a copy inside the pool (the same in both variants:
Mooncake's part is not what differs); what is timed is ``prefill_export`` of the prompt,
from its submission to its first token, with the borrowed blocks named. Run it with the
vLLM virtualenv's Python:

    .venv-vllm/bin/python benchmarks/vllm_borrow_bench.py --prefix-blocks 64 --rounds 5 --json /tmp/borrow.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BLOCK = 32


async def borrowed_prefill(engine: Any, prompt: list[int], prefix_blocks: int, tag: str) -> tuple[float, int, list[int]]:
    """Seconds to the first token of a prefill whose first ``prefix_blocks`` blocks were
    borrowed (lent, pulled, the originals evicted), the blocks it copied, and its first token."""
    import torch

    from kvmesh.engine.request import SamplingParams

    core = engine.core
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    hashes = engine.block_hashes(prompt)[:prefix_blocks]
    await engine._call(core.engine.reset_prefix_cache)
    async for _ in engine.generate(f"{tag}-plain", prompt, params):  # the peer's cached copy
        pass
    lent = await engine.lend_cached_blocks(f"{tag}-loan", hashes)
    staged = await engine.allocate_import(tag, prefix_blocks * BLOCK)
    assert len(lent) == prefix_blocks and staged is not None

    def pull() -> None:
        src, dst = torch.tensor(lent), torch.tensor(staged)
        for cache in core.kv_caches:
            cache[dst] = cache[src]

    await engine._call(pull)
    await engine.release_export(f"{tag}-loan")
    await engine._call(lambda: core.block_pool.evict_blocks(set(lent)))
    await engine.cache_imported_blocks(tag, hashes, None)
    copied = core.blocks_copied
    started = time.perf_counter()
    out = await engine.prefill_export(f"{tag}-prefill", prompt, params)
    seconds = time.perf_counter() - started
    await engine.release_export(f"{tag}-prefill")
    return seconds, core.blocks_copied - copied, out.new_token_ids


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvmesh.engine.loader.default_model import resolve_model
    from kvmesh.settings.worker import EngineSettings
    from kvmesh.worker.engines import create_engine
    from kvmesh.worker.vllm_core import VllmCore

    settings = EngineSettings(
        name="vllm", model=str(resolve_model(None)), block_size=BLOCK, kv_cache_bytes=args.kv_cache_mib * 2**20, num_threads=args.threads
    )
    engine = await create_engine(settings)
    adopt = VllmCore._adopt
    prompt = [(i * 7919 + 13) % 40000 + 100 for i in range(args.prefix_blocks * BLOCK + args.own_tokens)]
    times: dict[str, list[float]] = {"in place": [], "copied": []}
    copied: dict[str, int] = {}
    firsts: dict[str, list[int]] = {}
    try:
        for r in range(args.rounds + 1):  # the first round warms both up and is not counted
            for variant in (("in place", "copied") if r % 2 == 0 else ("copied", "in place")):
                # "copied": the prefill's borrowed blocks are not named in vLLM's cache (the code before)
                engine.core._adopt = adopt.__get__(engine.core) if variant == "in place" else (lambda *a, **k: None)
                seconds, n, first = await borrowed_prefill(engine, prompt, args.prefix_blocks, f"r{r}-{variant.replace(' ', '-')}")
                if r:
                    times[variant].append(seconds * 1e3)
                copied[variant], firsts[variant] = n, first
    finally:
        await engine.shutdown()
    return {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "prompt_tokens": len(prompt), "prefix_blocks": args.prefix_blocks, "block_size": BLOCK, "threads": args.threads,
        "ms": {k: {"p50": round(statistics.median(v), 2), "rounds": [round(x, 2) for x in v]} for k, v in times.items()},
        "blocks_copied": copied, "same_first_token": firsts["in place"] == firsts["copied"],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-blocks", type=int, default=64, help="borrowed blocks of 32 tokens")
    parser.add_argument("--own-tokens", type=int, default=32, help="prompt tokens after the borrowed prefix")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))
    from kvmesh.machine import cpu_flags, cpu_model

    report = asyncio.run(run(args))
    report["machine"] = {"cpu": cpu_model(), "cores": os.cpu_count(), "flags": cpu_flags()}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
