"""A decode worker whose pool holds fewer answers than arrive at once, through the HTTP API:
its pulls wait in line for blocks the running requests will not need (the engine's growth
reserve) instead of being let in only to preempt each other and be computed again. Every
answer equals one process's, nothing is preempted or retried, and the pools are at baseline
afterwards."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import SamplingParams
from kvmesh.worker.engines import DEFAULT_BLOCK_SIZE
from tests.mesh.client import post, worker_stats
from tests.mesh.meshes import MODEL, PROMPTS, assert_pools_at_baseline, make_mesh
from tests.mesh.test_metrics import metrics_urls, scrape, value

pytestmark = pytest.mark.slow

NEW_TOKENS = 48  # with a short prompt, 4 blocks of 16 by the end
KV_CACHE_MIB = 14  # the decode worker's pool: 19 float32 blocks (more in bfloat16)


async def complete(base_url: str, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    response = await post(base_url, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


async def test_a_full_decode_pool_queues_pulls_instead_of_preempting(tmp_path, default_model_dir):
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), served_model_name=MODEL, kv_cache_bytes=64 * 2**20))
    block_bytes = engine.kv_layout.block_bytes
    num_blocks = KV_CACHE_MIB * 2**20 // block_bytes
    count = -(-3 * num_blocks // (2 * 4))  # half as many answers again as the decode pool holds
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(count)]
    token_ids = [engine.tokenizer.encode(p) for p in prompts]
    want = [o.text for o in engine.generate(token_ids, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))]
    blocks = sum(-(-(len(ids) + NEW_TOKENS) // DEFAULT_BLOCK_SIZE["kvmesh"]) for ids in token_ids)
    assert blocks > 1.3 * num_blocks, (blocks, num_blocks)
    del engine
    # a pin outlasts a pull's wait in line
    mesh = make_mesh(tmp_path, default_model_dir, prefill=1, decode=1, kv_cache_mib=KV_CACHE_MIB, pin_ttl=30, request_timeout=60)
    try:
        stats = await worker_stats(mesh.nats.url, "default", "decode-2", **mesh.nats.connect_options())
        assert stats.num_blocks == num_blocks
        urls = await metrics_urls(mesh)
        # one answer first: until one has ended, the decode worker expects answers to use 70 %
        # of max_tokens (these use all of it)
        assert (await complete(mesh.base_url, prompts[0]))["choices"][0]["text"] == want[0]
        before = await scrape(urls["decode"])
        together = await asyncio.gather(*(complete(mesh.base_url, prompt) for prompt in prompts))
        after = await scrape(urls["decode"])
        assert [a["choices"][0]["text"] for a in together] == want
        preempted = value(after, "kvmesh:num_preemptions", "_total") - value(before, "kvmesh:num_preemptions", "_total")
        assert preempted == 0
        router = await scrape(urls["router"])
        assert value(router, "kvmesh:router_retries", "_total") == 0  # none came back overloaded
        await assert_pools_at_baseline(mesh, ["prefill-1", "decode-2"])
    finally:
        mesh.stop()
