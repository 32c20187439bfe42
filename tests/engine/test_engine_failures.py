"""Failure isolation (issue #7): a request whose sampling or detokenization raises fails
alone; a step that raises fails its batch; steps that keep failing end the engine, and that
is visible (``is_alive``, ``wait_dead``). Load and heartbeat are read without the thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

import kvmesh.engine.llm_engine as llm_engine_module
import kvmesh.engine.sampler as sampler_module
from kvmesh.engine.async_engine import AsyncEngine, EngineDeadError
from kvmesh.engine.block_pool import BlockRemoved, BlockStored
from kvmesh.engine.detokenizer import OutputText
from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import FinishReason, SamplingParams
from kvmesh.errors import ErrorCode

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
POISON = "<<poison>>"  # a stop string that marks the one request whose detokenizer fails
NUM_BLOCKS = 128


def config(model_dir, **overrides) -> EngineConfig:
    values = dict(model=str(model_dir), block_size=4, num_blocks=NUM_BLOCKS)
    values.update(overrides)
    return EngineConfig(**values)


@pytest.fixture
async def engine(tiny_model_dir):
    async with await AsyncEngine.create(config(tiny_model_dir)) as eng:
        yield eng


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    tok = LLMEngine(config(tiny_model_dir, num_blocks=4)).tokenizer
    return [tok.encode(t) for t in ["The river", "Bread and salt", "A program reads"]]


@pytest.fixture(scope="module")
def want(tiny_model_dir, prompts):
    """Greedy tokens of each prompt, from an engine that nothing went wrong in."""
    return [out.new_token_ids for out in LLMEngine(config(tiny_model_dir)).generate(prompts, GREEDY)]


async def collect(stream):
    return [out async for out in stream]


def tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


async def assert_pool_empty(eng: AsyncEngine) -> None:
    stats = await eng.pool_stats()
    assert (stats.num_in_use, stats.num_held) == (0, 0)
    assert eng.load_now() == {"running": 0, "waiting": 0, "free_blocks": NUM_BLOCKS, "reserved_blocks": 0}


class PoisonedText(OutputText):
    """Detokenizes as usual, but raises on the third token of a request stopping at POISON."""

    def add_token(self, token_id: int) -> bool:
        self.count = getattr(self, "count", 0) + 1
        if POISON in self._stop and self.count == 3:
            raise RuntimeError("injected detokenizer failure")
        return super().add_token(token_id)


async def test_a_failing_detokenizer_fails_that_request_only(engine, prompts, want, monkeypatch):
    monkeypatch.setattr(llm_engine_module, "OutputText", PoisonedText)
    poisoned = SamplingParams(max_tokens=10, ignore_eos=True, stop=(POISON,))
    bad, good = await asyncio.gather(
        collect(engine.generate("bad", prompts[0], poisoned)), collect(engine.generate("good", prompts[1], GREEDY))
    )
    assert [o.finish_reason for o in bad] == [None, None, FinishReason.ERROR]
    assert bad[-1].finished and bad[-1].new_token_ids == [] and bad[-1].text == ""
    assert bad[-1].error == "detokenizing failed: RuntimeError: injected detokenizer failure"
    assert tokens(bad) == want[0][:2]
    assert tokens(good) == want[1] and good[-1].finish_reason is FinishReason.LENGTH and good[-1].error is None
    await assert_pool_empty(engine)
    assert engine.is_alive()


async def test_a_failing_sampler_fails_that_request_only(engine, prompts, monkeypatch):
    real = sampler_module._sample_row

    def sample_row(logits, req):
        if req.request_id == "bad":
            raise ValueError("injected sampler failure")
        return real(logits, req)

    monkeypatch.setattr(sampler_module, "_sample_row", sample_row)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    alone = tokens(await collect(engine.generate("alone", prompts[1], seeded)))
    bad, good = await asyncio.gather(
        collect(engine.generate("bad", prompts[0], seeded)), collect(engine.generate("good", prompts[1], seeded))
    )
    assert len(bad) == 1 and bad[0].finish_reason is FinishReason.ERROR
    assert bad[0].error == "sampling failed: ValueError: injected sampler failure"
    assert bad[0].error_code is ErrorCode.REQUEST_FAILED  # its own: the same anywhere
    assert tokens(good) == alone
    await assert_pool_empty(engine)


async def test_a_failed_export_holds_no_blocks(engine, prompts, want, monkeypatch):
    """The first token of a prefill-for-export is sampled and the blocks are held; then its
    detokenizer raises: the output is an error without an export, and nothing stays held."""

    class FirstTokenFails(OutputText):
        def add_token(self, token_id: int) -> bool:
            if POISON in self._stop:
                raise RuntimeError("injected")
            return super().add_token(token_id)

    monkeypatch.setattr(llm_engine_module, "OutputText", FirstTokenFails)
    out = await engine.prefill_export("pd", prompts[0], SamplingParams(max_tokens=10, stop=(POISON,)))
    assert (out.finish_reason, out.kv_export) == (FinishReason.ERROR, None)
    assert out.error == "detokenizing failed: RuntimeError: injected"
    await assert_pool_empty(engine)
    ok = await engine.prefill_export("pd2", prompts[0], GREEDY)
    assert ok.finish_reason is FinishReason.LENGTH and ok.new_token_ids == want[0][:1]
    assert await engine.release_export("pd2")


async def test_a_failed_step_fails_its_batch_and_leaves_no_cached_garbage(engine, prompts, want, monkeypatch):
    """The forward raises once, before writing any KV: both requests of that step fail, the
    full blocks the step had named leave the prefix cache (BlockStored, then BlockRemoved),
    and the same prompt afterwards computes everything again and gives the right tokens."""
    real = engine.engine.model.forward
    calls = []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected forward failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.engine.model, "forward", forward)
    long_prompt = prompts[0] * 3  # several full blocks of 4 tokens
    await engine.take_kv_events()
    # Both requests in that one step: the engine thread is held on a command until both are
    # queued behind it (it runs every queued command before its next step). Without the hold,
    # a thread that woke between the two submissions stepped the first alone.
    gate = threading.Event()
    held = asyncio.ensure_future(engine._call(lambda: gate.wait(10)))
    streams = [asyncio.ensure_future(collect(engine.generate(f"b{i}", long_prompt, GREEDY))) for i in range(2)]
    await asyncio.sleep(0.05)
    gate.set()
    await held
    bad = await asyncio.gather(*streams)
    assert [[o.finish_reason for o in outs] for outs in bad] == [[FinishReason.ERROR], [FinishReason.ERROR]]
    assert bad[0][0].error == "step failed: RuntimeError: injected forward failure"
    # Not these requests' fault: retryable on another worker (request_failed is not).
    assert [outs[0].error_code for outs in bad] == [ErrorCode.INTERNAL, ErrorCode.INTERNAL]
    events = await engine.take_kv_events()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved]
    assert events[1].block_hashes == events[0].block_hashes and len(events[0].block_hashes) == len(long_prompt) // 4
    assert (await engine.pool_stats()).num_cached == 0
    await assert_pool_empty(engine)

    expected = LLMEngine(config(engine.engine.model_dir)).generate([long_prompt], GREEDY)[0].new_token_ids
    again = await collect(engine.generate("again", long_prompt, GREEDY))
    assert again[-1].num_cached_tokens == 0 and tokens(again) == expected
    assert tokens(await collect(engine.generate("next", prompts[1], GREEDY))) == want[1]
    assert engine.is_alive()


async def test_steps_that_keep_failing_end_the_engine(tiny_model_dir, prompts, monkeypatch):
    eng = await AsyncEngine.create(config(tiny_model_dir, max_failed_steps=3))
    error = RuntimeError("the device is gone")

    def forward(*args, **kwargs):
        raise error

    monkeypatch.setattr(eng.engine.model, "forward", forward)
    early_waiter = asyncio.create_task(eng.wait_dead())
    for index in range(2):
        outs = await collect(eng.generate(f"r{index}", prompts[0], GREEDY))
        assert [o.finish_reason for o in outs] == [FinishReason.ERROR]
        assert eng.is_alive()
    with pytest.raises(EngineDeadError):
        await collect(eng.generate("r2", prompts[0], GREEDY))
    assert await asyncio.wait_for(early_waiter, 5) is error
    assert await eng.wait_dead() is error
    assert not eng.is_alive()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(collect(eng.generate("late", prompts[1], GREEDY)), 1)
    with pytest.raises(EngineDeadError):
        await eng.load()
    await eng.shutdown()


async def test_a_normal_shutdown_is_a_death_without_error(tiny_model_dir):
    eng = await AsyncEngine.create(config(tiny_model_dir))
    waiter = asyncio.create_task(eng.wait_dead())
    await asyncio.sleep(0)
    assert eng.is_alive() and not waiter.done()
    await eng.shutdown()
    assert await asyncio.wait_for(waiter, 5) is None
    assert await eng.wait_dead() is None and not eng.is_alive()


class Gate:
    """Holds the engine thread inside the model forward until opened."""

    def __init__(self, model) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.real = model.forward

    def forward(self, *args, **kwargs):
        self.entered.set()
        assert self.opened.wait(10), "the test never opened the gate"
        return self.real(*args, **kwargs)


async def test_load_and_heartbeat_are_read_during_a_long_step(engine, prompts, want, monkeypatch):
    await asyncio.sleep(0.3)  # the idle thread goes round its loop every 0.1 s
    assert engine.heartbeat_age() < 1.0
    gate = Gate(engine.engine.model)
    monkeypatch.setattr(engine.engine.model, "forward", gate.forward)
    task = asyncio.create_task(collect(engine.generate("long", prompts[0], GREEDY)))
    assert await asyncio.to_thread(gate.entered.wait, 10)
    # The step is held: load_now answers at once, from the snapshot the thread took after
    # the command round that admitted the request (so it is still waiting there).
    assert engine.load_now() == {"running": 0, "waiting": 1, "free_blocks": NUM_BLOCKS, "reserved_blocks": 0}
    assert await engine.load() == engine.load_now()
    # A command waits for the thread; giving up on it must not hurt the thread.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(engine.pool_stats(), 0.05)
    await asyncio.sleep(0.3)
    assert engine.heartbeat_age() >= 0.3
    assert not task.done()
    gate.opened.set()
    outs = await asyncio.wait_for(task, 10)
    assert tokens(outs) == want[0]
    assert engine.is_alive() and engine.heartbeat_age() < 1.0
    await assert_pool_empty(engine)


async def test_a_submission_given_up_while_the_thread_is_busy_leaves_nothing(engine, prompts, want, monkeypatch):
    gate = Gate(engine.engine.model)
    monkeypatch.setattr(engine.engine.model, "forward", gate.forward)
    task = asyncio.create_task(collect(engine.generate("long", prompts[0], GREEDY)))
    assert await asyncio.to_thread(gate.entered.wait, 10)
    with pytest.raises(TimeoutError):  # its add_request is still queued behind the step
        await asyncio.wait_for(collect(engine.generate("quitter", prompts[1], GREEDY)), 0.05)
    gate.opened.set()
    assert tokens(await asyncio.wait_for(task, 10)) == want[0]
    await assert_pool_empty(engine)  # the quitter was added, then aborted
    assert tokens(await collect(engine.generate("quitter", prompts[1], GREEDY))) == want[1]


async def test_issue_7_a_tiny_temperature_does_not_stop_the_engine(engine, prompts, want):
    for index, params in enumerate([dict(temperature=1e-40), dict(temperature=1.0, top_p=1e-300)]):
        params = SamplingParams(max_tokens=10, ignore_eos=True, **params)
        outs = await collect(engine.generate(f"tiny{index}", prompts[0], params))
        assert tokens(outs) == want[0] and outs[-1].finish_reason is FinishReason.LENGTH
    assert tokens(await collect(engine.generate("after", prompts[1], GREEDY))) == want[1]
    assert engine.is_alive()


def test_the_failed_step_count_resets_after_a_good_step(tiny_model_dir, prompts, monkeypatch):
    eng = LLMEngine(config(tiny_model_dir, max_failed_steps=2))
    real = eng.model.forward
    plan = iter([True, False, True, True])  # fail, succeed, fail, fail

    def forward(*args, **kwargs):
        if next(plan):
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(eng.model, "forward", forward)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    reasons = []
    for index in range(3):
        eng.add_request(f"r{index}", prompts[0], params)
        reasons += [out.finish_reason for out in eng.step()]
    assert reasons == [FinishReason.ERROR, FinishReason.LENGTH, FinishReason.ERROR]
    eng.add_request("r3", prompts[0], params)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    assert not eng.has_unfinished() and eng.pool_stats().num_in_use == 0
