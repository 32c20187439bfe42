"""The engine on the default model (SmolLM2-135M-Instruct, float32) against transformers."""

from __future__ import annotations

import pytest

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import SamplingParams
from tests.engine.reference import load_reference, reference_greedy

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):\n",
    "The three primary colors are",
    "Water boils at a temperature of",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return LLMEngine(
        EngineConfig(model=str(default_model_dir), kv_cache_bytes=256 * 2**20, max_num_batched_tokens=64)
    )


@pytest.fixture(scope="module")
def expected(engine, default_model_dir):
    reference = load_reference(default_model_dir)
    prompts = [engine.tokenizer.encode(text) for text in TEXTS]
    shared = engine.tokenizer.encode(
        "You are a helpful assistant. Answer briefly and precisely, in one sentence. " * 3
    )
    long_prompts = [shared + engine.tokenizer.encode(t) for t in TEXTS[:3]]
    all_prompts = prompts + long_prompts
    return all_prompts, [reference_greedy(reference, p, NEW_TOKENS) for p in all_prompts]


def test_paris(engine):
    [out] = engine.generate([engine.tokenizer.encode("The capital of France is")], SamplingParams(max_tokens=3))
    assert out.text.startswith(" Paris")


def test_greedy_batched_chunked_and_prefix_cached(engine, expected):
    prompts, want = expected
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o.new_token_ids for o in outs] == want
    # Again: the shared system text and the earlier prompts now come from the prefix cache.
    again = engine.generate(prompts, params)
    assert [o.new_token_ids for o in again] == want
    assert all(o.num_cached_tokens > 0 for o in again[5:])


def test_chat_names_paris(engine):
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    [out] = engine.generate([tok.encode(text)], SamplingParams(max_tokens=32))
    assert "Paris" in out.text
    assert out.finish_reason.value == "stop"
