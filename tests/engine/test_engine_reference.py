"""The engine against transformers on a tiny random Llama / Qwen2: greedy tokens and logits,
alone, batched, in small prefill chunks, under preemption and with prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import SamplingParams
from tests.engine.reference import load_reference, reference_greedy, reference_logits

TEXTS = [
    "The capital of France is",
    "Rivers carry water from the mountains to the sea, and",
    "def add(a, b):\n    return",
    "Cooking pasta needs",
    "A",
    "The old city walls were built of stone and the market square was full of people selling bread",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tiny_model_dir, tiny_qwen2_dir):
    return tiny_model_dir if request.param == "llama" else tiny_qwen2_dir


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir)


@pytest.fixture(scope="module")
def prompts(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_blocks=8))
    return [engine.tokenizer.encode(text) for text in TEXTS]


@pytest.fixture(scope="module")
def expected(reference, prompts):
    return [reference_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]


def make_engine(model_dir, **overrides) -> LLMEngine:
    config = dict(model=str(model_dir), block_size=4, num_blocks=256, max_num_batched_tokens=256)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


def test_one_request_at_a_time(model_dir, prompts, expected):
    engine = make_engine(model_dir, enable_prefix_caching=False)
    for prompt, want in zip(prompts, expected):
        [out] = engine.generate([prompt], GREEDY)
        assert out.new_token_ids == want


def test_batched(model_dir, prompts, expected):
    engine = make_engine(model_dir)
    outs = engine.generate(prompts, GREEDY)
    assert [o.new_token_ids for o in outs] == expected


def test_chunked_prefill(model_dir, prompts, expected):
    # A 5-token budget splits most prompts into chunks that straddle block boundaries.
    engine = make_engine(model_dir, max_num_batched_tokens=5)
    outs = engine.generate(prompts, GREEDY)
    assert [o.new_token_ids for o in outs] == expected


def test_preemption(model_dir, prompts, expected, monkeypatch):
    engine = make_engine(model_dir, num_blocks=18)
    preempted = []
    original = engine.scheduler._preempt
    monkeypatch.setattr(engine.scheduler, "_preempt", lambda req: (preempted.append(req.request_id), original(req)))
    outs = engine.generate(prompts, GREEDY)
    assert preempted, "the pool was meant to be too small for all requests at once"
    assert [o.new_token_ids for o in outs] == expected
    assert engine.pool_stats().num_in_use == 0


def test_prefix_cache_hits(model_dir, reference, prompts):
    engine = make_engine(model_dir)
    base = prompts[5]
    engine.generate([base], GREEDY)
    longer = base + prompts[1]
    [out] = engine.generate([longer], GREEDY)
    assert out.num_cached_tokens == (len(base) // 4) * 4
    assert out.new_token_ids == reference_greedy(reference, longer, NEW_TOKENS)
    # The same prompt again: everything but the last token comes from the cache.
    [again] = engine.generate([longer], GREEDY)
    assert again.num_cached_tokens == ((len(longer) - 1) // 4) * 4
    assert again.new_token_ids == out.new_token_ids


def _engine_logits(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """Logits for every prompt position, computed step by step as the scheduler chunks it."""
    req = engine.add_request("logits", tokens, SamplingParams(max_tokens=1))
    rows = []
    while not req.is_finished:
        out = engine.scheduler.schedule()
        input_ids, positions, meta, _, _ = engine.runner.prepare(out)
        hidden = engine.model.forward(input_ids, positions, meta, engine.kv_pool)
        rows.append(engine.model.logits(hidden))
        sampled = [int(rows[-1][-1].argmax())] if out.scheduled[0].samples else []
        engine.scheduler.update_from_output(out, sampled)
    return torch.cat(rows)


@pytest.mark.parametrize("budget", [256, 3])
def test_logits_close(model_dir, reference, prompts, budget):
    engine = make_engine(model_dir, max_num_batched_tokens=budget)
    tokens = prompts[5] + prompts[1]
    got = _engine_logits(engine, tokens)
    want = reference_logits(reference, tokens)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_decode_logits_close_after_cache_hit(model_dir, reference, prompts):
    engine = make_engine(model_dir)
    engine.generate([prompts[5]], GREEDY)
    tokens = prompts[5] + prompts[3]
    got = _engine_logits(engine, tokens)
    want = reference_logits(reference, tokens)
    hit = (len(prompts[5]) // 4) * 4
    torch.testing.assert_close(got, want[hit:], atol=2e-4, rtol=1e-4)
