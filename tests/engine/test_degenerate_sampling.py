"""Degenerate sampling values (issue #7): a temperature or a top-p too small for float32
is greedy, never a crash, and the engine serves the next request as before."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import Request, SamplingParams
from kvmesh.engine.sampler import sample


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=256))


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.encode("The market square was full of")


@pytest.fixture(scope="module")
def greedy(engine, prompt):
    return engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].new_token_ids


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1e-40),
        dict(temperature=1e-6),
        dict(temperature=1.0, top_p=1e-300),  # 0.0 in float32
        dict(temperature=1.0, top_p=1e-45),  # the smallest float32 subnormal
        dict(temperature=1e-40, top_k=1),
    ],
    ids=["temperature-1e-40", "temperature-1e-6", "top_p-1e-300", "top_p-1e-45", "top_k-1-temperature-1e-40"],
)
def test_degenerate_values_are_greedy_and_the_engine_goes_on(engine, prompt, greedy, params):
    [out] = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, seed=5, **params))
    assert out.new_token_ids == greedy
    assert out.error is None
    [after] = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    assert after.new_token_ids == greedy
    assert engine.pool_stats().num_in_use == 0


def test_a_nan_temperature_is_refused():
    with pytest.raises(ValueError):
        SamplingParams(temperature=float("nan"))


def test_greedy_below_the_sampling_epsilon():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=9.99e-6).greedy
    assert SamplingParams(temperature=1e-40).greedy
    assert SamplingParams(temperature=2.0, top_k=1).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert not SamplingParams(temperature=0.7).greedy


def _request(**params) -> Request:
    return Request("r", [1], SamplingParams(**params))


def test_top_p_that_rounds_to_zero_keeps_the_top_token():
    logits = torch.tensor([[0.5, 3.0, 2.9, -1.0]])
    req = _request(temperature=1.0, top_p=1e-300, seed=0)
    assert {sample(logits, [req])[0] for _ in range(50)} == {1}


def test_non_finite_scores_fall_back_to_the_argmax():
    # A temperature at the floor still overflows these logits to inf; all-NaN rows too.
    huge = torch.tensor([[3e38, -3e38, 1e38, 0.0]])
    assert sample(huge, [_request(temperature=1e-5, seed=0)]) == [0]
    nan = torch.full((1, 4), float("nan"))
    nan[0, 2] = 1.0
    assert sample(nan, [_request(temperature=1.0, seed=0)]) == [2]


def test_a_temperature_below_the_epsilon_never_samples():
    # Scaled by 1e-6 these two logits are 0.24 apart: sampling would pick either.
    logits = torch.tensor([[2.0, 2.0 - 2.4e-7, -5.0]])
    req = _request(temperature=1e-6, seed=0)
    assert {sample(logits, [req])[0] for _ in range(50)} == {0}
