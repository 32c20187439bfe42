"""Sampling parameters end to end: seeds, top-k, top-p, stop strings, stop tokens, limits."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import FinishReason, Request, SamplingParams
from kvmesh.engine.sampler import sample


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=256))


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.encode("The market square was full of")


def run(engine, prompt, **params):
    [out] = engine.generate([prompt], SamplingParams(**params))
    return out


def test_seed_reproducible_and_seeds_differ(engine, prompt):
    a = run(engine, prompt, temperature=1.5, seed=7, max_tokens=16, ignore_eos=True)
    b = run(engine, prompt, temperature=1.5, seed=7, max_tokens=16, ignore_eos=True)
    c = run(engine, prompt, temperature=1.5, seed=8, max_tokens=16, ignore_eos=True)
    assert a.new_token_ids == b.new_token_ids
    assert a.new_token_ids != c.new_token_ids


def test_seeded_request_unaffected_by_batch_neighbours(engine, prompt):
    alone = run(engine, prompt, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    other = engine.tokenizer.encode("Rivers run")
    batch = engine.generate(
        [other, prompt],
        [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
         SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)],
    )
    assert batch[1].new_token_ids == alone.new_token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(engine, prompt):
    greedy = run(engine, prompt, max_tokens=12, ignore_eos=True)
    assert run(engine, prompt, temperature=2.0, top_k=1, seed=1, max_tokens=12, ignore_eos=True).new_token_ids == greedy.new_token_ids
    assert run(engine, prompt, temperature=2.0, top_p=1e-6, seed=1, max_tokens=12, ignore_eos=True).new_token_ids == greedy.new_token_ids


def _request(**params) -> Request:
    return Request("r", [1], SamplingParams(**params))


def test_top_k_support():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0, 2.8]])
    req = _request(temperature=5.0, top_k=2, seed=0)
    seen = {sample(logits, [req])[0] for _ in range(300)}
    assert seen == {0, 1}


def test_top_p_support():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    req = _request(temperature=1.0, top_p=0.7, seed=0)
    seen = {sample(logits, [req])[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7, so the second token is needed; the third is not


def test_max_tokens(engine, prompt):
    out = run(engine, prompt, max_tokens=5, ignore_eos=True)
    assert len(out.new_token_ids) == 5 and out.finish_reason is FinishReason.LENGTH


def test_stop_token_ids(engine, prompt):
    greedy = run(engine, prompt, max_tokens=12, ignore_eos=True).new_token_ids
    stop_at = greedy[4]
    first = greedy.index(stop_at)
    out = run(engine, prompt, max_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,))
    assert out.new_token_ids == greedy[: first + 1]
    assert out.finish_reason is FinishReason.STOP


def test_eos_stops_unless_ignored(engine, prompt):
    greedy = run(engine, prompt, max_tokens=12, ignore_eos=True).new_token_ids
    eos = greedy[3]
    first = greedy.index(eos)
    engine.eos_token_ids, saved = (eos,), engine.eos_token_ids
    try:
        stopped = run(engine, prompt, max_tokens=12)
        ignored = run(engine, prompt, max_tokens=12, ignore_eos=True)
    finally:
        engine.eos_token_ids = saved
    assert stopped.new_token_ids == greedy[: first + 1] and stopped.finish_reason is FinishReason.STOP
    assert ignored.new_token_ids == greedy


def test_stop_string_cuts_text_and_is_never_streamed(engine, prompt):
    greedy = run(engine, prompt, max_tokens=16, ignore_eos=True)
    text = greedy.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    req_id = "stopper"
    engine.add_request(req_id, prompt, SamplingParams(max_tokens=16, ignore_eos=True, stop=(stop,)))
    deltas, reason = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.text)
            reason = out.finish_reason
    streamed = "".join(deltas)
    assert streamed == text[: text.index(stop)]
    assert reason is FinishReason.STOP
    assert engine.pool_stats().num_in_use == 0


@pytest.mark.parametrize(
    "params",
    [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1), dict(max_tokens=0), dict(stop=("",))],
)
def test_bad_sampling_params(params):
    with pytest.raises(ValueError):
        SamplingParams(**params)
