"""Every sampling option in one batch, on ``KVMESH_TEST_DEVICE`` (the CPU unless it names
another): a tiny temperature is greedy, a seed repeats, penalties, min_p, top-k/p and logit
bias leave every token in the vocabulary, logprobs are the reference model's, and the pool
is empty afterwards. Run with ``KVMESH_TEST_DEVICE=cuda`` on a GPU."""

from __future__ import annotations

import math

import torch

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import SamplingParams
from tests.engine.reference import DEVICE, load_reference, reference_greedy, reference_logits, skip_unless_device_present

skip_unless_device_present()

NEW = 10


def test_every_sampling_option_in_one_batch(tiny_model_dir) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=128, device=DEVICE))
    reference = load_reference(tiny_model_dir, device=DEVICE)
    prompt = engine.tokenizer.encode("The river begins high in the mountains")
    vocab = engine.model_config.vocab_size
    options = [
        SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1e-6),
        SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.0, seed=7),
        SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.0, seed=7),
        SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
        SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.7, presence_penalty=1.5,
                       frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={5: 3.0}),  # fmt: skip
    ]
    outs = engine.generate([prompt] * len(options), options)
    greedy = reference_greedy(reference, prompt, NEW)
    assert outs[0].new_token_ids == greedy
    assert outs[1].new_token_ids == greedy, "a tiny temperature is greedy"
    assert outs[2].new_token_ids == outs[3].new_token_ids, "the same seed, the same tokens"
    assert outs[4].new_token_ids[0] in torch.topk(reference_logits(reference, prompt)[-1], 5).indices.tolist()
    for out in outs:
        assert len(out.new_token_ids) == NEW and all(0 <= t < vocab for t in out.new_token_ids)
    want = torch.log_softmax(reference_logits(reference, prompt + greedy), dim=-1)
    for index, (token, lp) in enumerate(zip(greedy, outs[0].logprobs)):
        assert lp is not None and lp.token_id == token and math.isfinite(lp.logprob)
        assert abs(lp.logprob - float(want[len(prompt) - 1 + index, token])) < 1e-3
        assert lp.top[0][0] == token and len(lp.top) == 3
    stats = engine.pool_stats()
    assert stats.num_in_use == 0 and stats.num_held == 0
