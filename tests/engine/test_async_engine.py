"""The async interface: streaming, abort, concurrency, and the disaggregation hooks (on
``KVMESH_TEST_DEVICE``, the CPU unless it names another)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.engine.async_engine import AsyncEngine, EngineDeadError
from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import FinishReason, SamplingParams
from tests.engine.reference import DEVICE, skip_unless_device_present

skip_unless_device_present()

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def config(model_dir, **overrides) -> EngineConfig:
    values = dict(model=str(model_dir), block_size=4, num_blocks=128, device=DEVICE)
    values.update(overrides)
    return EngineConfig(**values)


@pytest.fixture
async def engine(tiny_model_dir):
    async with await AsyncEngine.create(config(tiny_model_dir)) as eng:
        yield eng


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    tok = LLMEngine(config(tiny_model_dir, num_blocks=4)).tokenizer
    texts = ["The river", "Bread and salt", "A program reads", "Mountains rise above", "Once upon"]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def single_process(tiny_model_dir, prompts):
    return LLMEngine(config(tiny_model_dir)).generate(prompts, GREEDY)


async def collect(stream):
    outs = [out async for out in stream]
    return outs


async def test_stream_matches_sync_engine(engine, prompts, single_process):
    outs = await collect(engine.generate("a", prompts[0], GREEDY))
    assert [t for o in outs for t in o.new_token_ids] == single_process[0].new_token_ids
    assert "".join(o.text for o in outs) == single_process[0].text
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert not any(o.finished for o in outs[:-1])


async def test_concurrent_streams(engine, prompts, single_process):
    results = await asyncio.gather(*(collect(engine.generate(f"r{i}", p, GREEDY)) for i, p in enumerate(prompts)))
    for outs, want in zip(results, single_process):
        assert [t for o in outs for t in o.new_token_ids] == want.new_token_ids


async def test_leaving_the_stream_aborts(engine, prompts):
    stream = engine.generate("leaver", prompts[0], SamplingParams(max_tokens=1000, ignore_eos=True))
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(100):
        stats = await engine.pool_stats()
        if stats.num_in_use == 0:
            break
        await asyncio.sleep(0.01)
    assert stats.num_in_use == 0
    assert (await engine.load())["running"] == 0


async def test_bad_request_is_refused_and_nothing_leaks(engine):
    with pytest.raises(ValueError):
        await collect(engine.generate("bad", [10**9], GREEDY))
    with pytest.raises(ValueError):
        await collect(engine.generate("empty", [], GREEDY))
    assert (await engine.pool_stats()).num_in_use == 0


async def test_duplicate_request_id(engine, prompts):
    stream = engine.generate("dup", prompts[0], SamplingParams(max_tokens=50, ignore_eos=True))
    first = await stream.__anext__()
    assert first.new_token_ids
    with pytest.raises(ValueError):
        await collect(engine.generate("dup", prompts[1], GREEDY))
    await stream.aclose()


async def test_prefill_export_then_decode_from_import(tiny_model_dir, prompts, single_process):
    """Prefill on one engine, copy the held blocks into another, decode there: the same
    greedy tokens as one process, and both pools empty afterwards."""
    async with await AsyncEngine.create(config(tiny_model_dir)) as prefill, await AsyncEngine.create(
        config(tiny_model_dir, num_blocks=64)
    ) as decode:
        for index, prompt in enumerate(prompts):
            rid = f"pd{index}"
            first = await prefill.prefill_export(rid, prompt, GREEDY)
            export = first.kv_export
            assert export is not None and export.num_tokens == len(prompt)
            assert first.new_token_ids == single_process[index].new_token_ids[:1]
            assert (await prefill.pool_stats()).num_held == len(export.block_ids)

            block_ids = await decode.allocate_import(rid, export.num_tokens)
            assert block_ids is not None and len(block_ids) == len(export.block_ids)
            data = prefill.engine.kv_pool.read_blocks(export.block_ids)
            decode.engine.kv_pool.write_blocks(block_ids, data)
            assert await prefill.release_export(rid)

            outs = await collect(decode.generate_from_import(rid, prompt, first.new_token_ids[0], rid, GREEDY))
            tokens = [t for o in outs for t in o.new_token_ids]
            assert tokens == single_process[index].new_token_ids
            assert "".join(o.text for o in outs) == single_process[index].text
        for eng in (prefill, decode):
            stats = await eng.pool_stats()
            assert stats.num_in_use == 0 and stats.num_held == 0


async def test_import_released_without_decode(engine):
    ids = await engine.allocate_import("orphan", 9)
    assert ids is not None and len(ids) == 3
    assert (await engine.pool_stats()).num_held == 3
    assert await engine.release_import("orphan")
    assert not await engine.release_import("orphan")
    assert (await engine.pool_stats()).num_in_use == 0


async def test_import_without_room(tiny_model_dir):
    async with await AsyncEngine.create(config(tiny_model_dir, num_blocks=4)) as eng:
        assert await eng.allocate_import("big", 100) is None


async def test_shutdown_fails_new_calls(tiny_model_dir, prompts):
    eng = await AsyncEngine.create(config(tiny_model_dir))
    await eng.shutdown()
    with pytest.raises(EngineDeadError):
        await collect(eng.generate("late", prompts[0], GREEDY))


async def test_queue_wait_is_reported_on_the_first_output_only(engine, prompts):
    outs = await collect(engine.generate("q", prompts[0], GREEDY))
    assert outs[0].queue_seconds is not None and 0 <= outs[0].queue_seconds < 5
    assert all(o.queue_seconds is None for o in outs[1:])


async def test_a_prefix_lent_by_a_peer_gives_the_same_tokens(tiny_model_dir, prompts):
    """Engine A computed a prompt; B copies A's cached blocks for its prefix, caches them, and
    then serves a longer prompt with those blocks as prefix hits: same greedy tokens as B
    computing everything itself; both pools end with no reference left."""
    async with await AsyncEngine.create(config(tiny_model_dir)) as lender, await AsyncEngine.create(
        config(tiny_model_dir, num_blocks=64)
    ) as borrower:
        base = prompts[0] * 4 + prompts[1] * 3  # several full blocks of 4 tokens
        longer = base + prompts[2]
        want = LLMEngine(config(tiny_model_dir)).generate([longer], GREEDY)[0].new_token_ids
        await collect(lender.generate("warm", base, GREEDY))
        hashes = lender.engine.block_hashes(base)
        assert await lender.cached_prefix_length(hashes) == len(hashes)

        lent = await lender.lend_cached_blocks("lend-1", hashes)
        assert len(lent) == len(hashes)
        local = await borrower.allocate_import("borrow-1", len(lent) * 4)
        borrower.engine.kv_pool.write_blocks(local, lender.engine.kv_pool.read_blocks(lent))
        await borrower.cache_imported_blocks("borrow-1", hashes, None)
        assert await lender.release_import("lend-1")

        outs = await collect(borrower.generate("after", longer, GREEDY))
        assert outs[-1].num_cached_tokens == len(hashes) * 4
        assert [t for o in outs for t in o.new_token_ids] == want
        for eng in (lender, borrower):
            stats = await eng.pool_stats()
            assert stats.num_in_use == 0 and stats.num_held == 0


async def test_abort_from_elsewhere_ends_the_stream(engine, prompts):
    """A cancel that arrives from outside the stream (a router's cancel message) must end
    the stream that a worker task is iterating, or that task would wait forever."""
    outs = []

    async def consume():
        async for out in engine.generate("victim", prompts[0], SamplingParams(max_tokens=1000, ignore_eos=True)):
            outs.append(out)

    task = asyncio.create_task(consume())
    while not outs:
        await asyncio.sleep(0.01)
    assert await engine.abort("victim")
    await asyncio.wait_for(task, 5)
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.ABORT
    assert (await engine.pool_stats()).num_in_use == 0


async def test_kv_events_are_taken_without_a_trip_to_an_idle_engine(engine, prompts, monkeypatch):
    """The worker's publisher asks 10 times a second; with nothing waiting the answer comes
    from here, not from a command the engine's thread wakes for."""
    commands = []
    real_call = engine._call

    async def counted(command):
        commands.append(command)
        return await real_call(command)

    monkeypatch.setattr(engine, "_call", counted)
    assert await engine.take_kv_events() == [] and commands == []
    async for _ in engine.generate("a", prompts[0] * 3, GREEDY):
        pass
    commands.clear()  # the request's own
    events = await engine.take_kv_events()  # the prompt's full blocks, cached
    assert events and len(commands) == 1
    assert await engine.take_kv_events() == [] and len(commands) == 1
