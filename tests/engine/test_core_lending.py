"""Engines on one machine lending each other their cores while idle (``core_lending``)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.core_lending import BORROWING, HANDOVER, IDLE, OWN, CoreLending, LendingCounts, parse_lending


def board(tmp_path, slots: int = 3):
    path = tmp_path / "cores"
    CoreLending.create(path, slots)
    return path


def test_an_engine_runs_on_every_core_while_the_others_are_idle(tmp_path):
    path = board(tmp_path)
    prefill, decode = CoreLending(path, 0, own=1, most=2), CoreLending(path, 1, own=1, most=2)
    assert decode.threads_for_step() == 2  # the prefill worker has nothing to do
    assert path.read_bytes() == bytes([IDLE, BORROWING, IDLE])
    started = time.monotonic()
    assert prefill.threads_for_step() == 1  # the decode worker is busy: its own share
    assert time.monotonic() - started >= HANDOVER  # having waited for a step that never came
    assert decode.threads_for_step() == 1  # and so the decode worker's next step
    assert path.read_bytes() == bytes([OWN, OWN, IDLE])
    prefill.idle()
    assert decode.threads_for_step() == 2
    decode.idle()
    assert path.read_bytes() == bytes(3)
    # what each counted (its worker's kvmesh:core_lending): two borrowed steps; one wait given up
    assert decode.counts == LendingCounts(borrowed=2, given_back=0, wait_given_up=0)
    assert prefill.counts == LendingCounts(borrowed=0, given_back=0, wait_given_up=1)


def test_an_engine_turning_busy_waits_for_the_borrowers_step_in_flight(tmp_path):
    # the borrower's next step starts 50 ms later and keeps to its share: only then does
    # the newcomer step, so the two never run a step on the same cores
    path = board(tmp_path, 2)
    borrower, newcomer = CoreLending(path, 0, own=1, most=2), CoreLending(path, 1, own=1, most=2)
    assert borrower.threads_for_step() == 2
    next_step = threading.Timer(0.05, borrower.threads_for_step)
    next_step.start()
    started = time.monotonic()
    assert newcomer.threads_for_step() == 1
    waited = time.monotonic() - started
    next_step.join()
    assert 0.04 < waited < HANDOVER, waited
    assert path.read_bytes() == bytes([OWN, OWN])
    started = time.monotonic()
    assert newcomer.threads_for_step() == 1  # busy already: no wait
    assert time.monotonic() - started < 0.01


def test_an_engine_that_died_busy_holds_its_share_until_it_is_back(tmp_path):
    path = board(tmp_path, 2)
    dead = CoreLending(path, 0, own=1, most=2)
    dead.threads_for_step()
    dead._board.close()  # the process ended without marking itself idle
    other = CoreLending(path, 1, own=1, most=2)
    assert other.threads_for_step() == 1
    CoreLending(path, 0, own=1, most=2)  # the restarted worker starts idle
    assert other.threads_for_step() == 2


def test_own_is_at_least_one_and_most_at_least_own(tmp_path):
    lending = CoreLending(board(tmp_path), 2, own=0, most=0)
    assert (lending.own, lending.most) == (1, 1)
    assert lending.threads_for_step() == 1


def test_bad_specs_are_refused(tmp_path):
    path = board(tmp_path, 2)
    with pytest.raises(ValueError, match="PATH:SLOT"):
        parse_lending(str(path), 1)
    with pytest.raises(ValueError, match="not on the board"):
        parse_lending(f"{path}:2", 1)
    assert parse_lending(f"{path}:1", 1).slot == 1


class StepRecorder:
    """An engine stand-in for ``AsyncEngine``: ``work`` steps, recording the engine thread's
    torch threads at each."""

    def __init__(self) -> None:
        self.work = 0
        self.threads: list[int] = []
        self.last_step_tokens = 0
        self.stepped = threading.Event()

    def has_unfinished(self) -> bool:
        return self.work > 0

    def load(self) -> dict[str, int]:
        return {"running": self.work, "waiting": 0, "free_blocks": 0}

    def step(self) -> list:
        self.threads.append(torch.get_num_threads())
        self.work -= 1
        self.last_step_tokens = 1
        if not self.work:
            self.stepped.set()
        return []


async def test_the_engine_thread_takes_the_cores_the_board_allows(tmp_path):
    path = board(tmp_path, 2)
    other = CoreLending(path, 1, own=1, most=2)
    recorder = StepRecorder()
    engine = AsyncEngine(recorder, CoreLending(path, 0, own=1, most=2))  # type: ignore[arg-type]
    try:

        async def run(steps: int) -> list[int]:
            recorder.stepped.clear()
            recorder.threads.clear()
            await engine._call(lambda: setattr(recorder, "work", steps))
            assert await asyncio.to_thread(recorder.stepped.wait, 5)
            return list(recorder.threads)

        assert await run(3) == [2, 2, 2]  # the other engine idle: both cores
        for _ in range(50):  # then it marks itself idle, waiting for work
            if path.read_bytes()[0] == 0:
                break
            await asyncio.sleep(0.02)
        assert path.read_bytes() == b"\x00\x00"
        other.threads_for_step()  # the other engine has work
        assert await run(2) == [1, 1]
        other.idle()
        assert await run(1) == [2]
    finally:
        await engine.shutdown()
    assert path.read_bytes() == b"\x00\x00"


def test_a_borrower_gives_the_cores_back_between_layers_when_their_owner_turns_busy(tmp_path):
    path = board(tmp_path, 2)
    borrower, owner = CoreLending(path, 0, own=1, most=2), CoreLending(path, 1, own=1, most=2)
    assert borrower.threads_for_step() == 2
    assert borrower.give_back() is None  # the owner still idle: keep them
    # the owner turns busy in the middle of the borrower's step: it waits for the give-back,
    # which the borrower's next layer makes (20 ms later here), not for the step's end
    layer = threading.Timer(0.02, lambda: given.append(borrower.give_back()))
    given: list[int | None] = []
    layer.start()
    started = time.monotonic()
    assert owner.threads_for_step() == 1
    waited = time.monotonic() - started
    layer.join()
    assert given == [1] and 0.01 < waited < HANDOVER / 2, (given, waited)
    assert path.read_bytes() == bytes([OWN, OWN])
    assert borrower.give_back() is None  # on its share already
    assert borrower.threads_for_step() == 1
    assert borrower.counts == LendingCounts(borrowed=1, given_back=1, wait_given_up=0)
    assert owner.counts == LendingCounts()  # the borrower gave them back in time


async def test_a_step_on_borrowed_cores_drops_to_its_share_at_the_next_layer(tmp_path):
    """Through the engine: a long prefill on both cores, the other engine turning busy in the
    middle of it; the layers after that run on one thread, and the other engine waited less
    than the step took."""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams
    from kvmesh.testing.tiny_model import build_tiny_model

    path = board(tmp_path, 2)
    model_dir = build_tiny_model(tmp_path / "tiny", arch="llama", seed=1, num_layers=12)
    llm = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", block_size=4, num_blocks=512, max_num_batched_tokens=2048))
    layers: list[int] = []
    engine = AsyncEngine(llm, CoreLending(path, 0, own=1, most=2))
    hook = llm.model.between_layers
    assert hook is not None

    def recorded() -> None:  # the other engine turns busy at the fifth layer; each layer slowed to 10 ms
        if len(layers) == 4:
            threading.Thread(target=lambda: waits.append(owner_turns_busy())).start()
        time.sleep(0.01)
        hook()
        layers.append(torch.get_num_threads())

    def owner_turns_busy() -> float:
        started = time.monotonic()
        assert owner.threads_for_step() == 1
        return time.monotonic() - started

    waits: list[float] = []
    owner = CoreLending(path, 1, own=1, most=2)
    llm.model.between_layers = recorded
    threads_before = torch.get_num_threads()
    try:
        prompt = [5 + i % 200 for i in range(1500)]
        async for _ in engine.generate("long", prompt, SamplingParams(max_tokens=1)):
            pass
    finally:
        await engine.shutdown()
        torch.set_num_threads(threads_before)  # the engine thread's changes are the process's
    first_step = layers[: len(llm.model.layers) - 1]
    assert first_step[:4] == [2, 2, 2, 2] and set(first_step[6:]) == {1}, first_step
    assert waits and waits[0] < 0.1  # a few layers of 10 ms, not the rest of the step
    assert path.read_bytes()[1] == OWN


async def test_the_layer_hook_goes_with_the_engine_thread(tmp_path):
    """The model's hook is the lending engine's while its thread runs, and cleared when it
    ends (the board it reads is closed then); an engine without lending sets none."""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.testing.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny", arch="llama", seed=1)
    llm = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", block_size=4, num_blocks=64))
    engine = AsyncEngine(llm, CoreLending(board(tmp_path, 2), 0, own=1, most=2))
    assert llm.model.between_layers == engine._give_back
    await engine.shutdown()
    assert llm.model.between_layers is None
    plain = AsyncEngine(llm)
    assert llm.model.between_layers is None
    await plain.shutdown()
