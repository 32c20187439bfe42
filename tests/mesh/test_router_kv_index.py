"""The router's own copy of the KV index (``--kv-index replica``, the default): a mesh with no
kv-metadata at all still routes a chat's next turn to the decode worker holding its prefix,
and a router restarted by the mesh's supervisor (as ``kvmesh up`` restarts it) learns what the
idle workers already hold from their snapshots. Before the replica, routing by prefix needed
kv-metadata's answer: without it every turn went to the prefill worker on load alone."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import nats
import pytest

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import SamplingParams
from kvmesh.hashing import hash_to_hex, hash_token_blocks
from kvmesh.protocol import KVEventBatch, Subjects
from tests.mesh.client import post, worker_stats
from tests.mesh.meshes import MODEL, make_mesh

pytestmark = pytest.mark.slow

OPENING = "A lighthouse keeper writes to the sea every evening. Here is tonight's letter:"
FOLLOW_UPS = [" Thank you. And what did the sea answer?", " And the keeper's answer to that?"]
TOKENS = 40
BLOCK = 16


async def router_index_blocks(client: httpx.AsyncClient) -> float:
    """The router's ``kvmesh:router_kv_index_blocks``: block hashes in its copy of the index."""
    text = (await client.get("/metrics")).text
    found = re.search(r"^kvmesh:router_kv_index_blocks\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert found, "no kvmesh:router_kv_index_blocks in the router's /metrics"
    return float(found.group(1))


@pytest.fixture(scope="module")
def turns(default_model_dir) -> list[dict]:
    """One process's greedy conversation by token ids: each turn's prompt and answer."""
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), served_model_name=MODEL, kv_cache_bytes=32 * 2**20))
    out, prompt = [], engine.tokenizer.encode(OPENING)
    for message in [*FOLLOW_UPS, ""]:
        [answer] = engine.generate([prompt], SamplingParams(max_tokens=TOKENS, ignore_eos=True))
        out.append({"prompt": prompt, "text": answer.text})
        prompt = prompt + answer.new_token_ids + engine.tokenizer.encode(message)
    return out


async def test_turns_follow_their_prefix_without_kv_metadata_and_across_a_router_restart(tmp_path, default_model_dir, turns):
    mesh = await asyncio.to_thread(make_mesh, tmp_path, default_model_dir, prefill=1, decode=1, kv_metadata=False, supervise=True)
    nc = await nats.connect(mesh.nats.url, connect_timeout=5, **mesh.nats.connect_options())
    published: set[str] = set()  # the decode worker's stored blocks, as its batches go out

    async def seen(msg) -> None:
        for event in KVEventBatch.decode(msg.data).events:
            published.update(event.block_hashes if event.kind == "stored" else ())

    async def stats(worker_id: str):
        return await worker_stats(mesh.nats.url, "default", worker_id, **mesh.nats.connect_options())

    async def turn(number: int) -> dict:
        body = {"model": MODEL, "prompt": turns[number]["prompt"], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        response = await post(mesh.base_url, "/v1/completions", body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["choices"][0]["text"] == turns[number]["text"]
        return answer

    async def published_by_decode(number: int) -> int:
        """Until the decode worker has published the blocks of turn ``number``'s prompt that
        the previous answer filled (the router's copy takes the same batches); how many."""
        prompt = turns[number]["prompt"]
        held = (len(turns[number - 1]["prompt"]) + TOKENS - 1) // BLOCK  # the last answer token is never fed back
        chain = [hash_to_hex(h) for h in hash_token_blocks(prompt, BLOCK, (MODEL,))][:held]
        deadline = time.monotonic() + 10
        while not set(chain) <= published:
            assert time.monotonic() < deadline, "the decode worker never published the answer's blocks"
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # the router's delivery of the same batch (it says nothing of it)
        return held

    async def prefilled_on_the_decode_worker(number: int) -> None:
        held = await published_by_decode(number)
        served = (await stats("prefill-1")).bytes_served
        answer = await turn(number)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == held * BLOCK  # the previous answer's blocks too
        assert (await stats("prefill-1")).bytes_served == served  # no KV moved: the decode worker prefilled it

    try:
        await nc.subscribe(Subjects("default").kv_events_from("decode-2"), cb=seen)
        await nc.flush()
        await turn(0)
        await prefilled_on_the_decode_worker(1)
        # The router dies and the supervisor starts another; the workers stay idle meanwhile,
        # so only their snapshots can tell the new router what they hold.
        old = mesh.router.pid
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient(base_url=mesh.base_url, timeout=5) as client:
            while True:
                try:
                    ready = (await client.get("/health")).status_code == 200 and mesh.router.pid != old
                except httpx.HTTPError:
                    ready = False
                if ready:
                    break
                assert time.monotonic() < deadline, "the router did not come back"
                await asyncio.sleep(0.2)
            # its snapshots were asked for as it loaded the directory: what they held, in its copy
            while await router_index_blocks(client) < 1:
                assert time.monotonic() < deadline, "the new router's copy of the index stayed empty"
                await asyncio.sleep(0.2)
        await prefilled_on_the_decode_worker(2)
        for worker_id in ("prefill-1", "decode-2"):
            pool = await stats(worker_id)
            assert (pool.num_in_use, pool.num_held, pool.pins) == (0, 0, 0), pool
    finally:
        await nc.close()
        await asyncio.to_thread(mesh.stop)
