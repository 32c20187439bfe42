"""Penalties, logit bias, min_p and min_tokens: exact against transformers' logits processors
on the tiny model's real logits, and the engine's greedy tokens against a transformers loop
that uses those processors."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.logits_processors import process_logits
from kvmesh.engine.request import FinishReason, Request, SamplingParams
from kvmesh.engine.sampler import filtered_scores, sample_rows
from kvmesh.protocol import SamplingSpec
from tests.engine.reference import load_reference, reference_logits

NEW_TOKENS = 12


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's formula written out: logit -= frequency * count + presence * (count > 0),
    counted over the generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for token, count in Counter(input_ids[0, self.prompt_len :].tolist()).items():
            scores[0, token] -= self.frequency * count + self.presence
        return scores


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=256))


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return load_reference(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.encode("The river carries water from the mountains to the sea, and the river")


@pytest.fixture(scope="module")
def generated(engine, prompt):
    [out] = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    return out.new_token_ids


@pytest.fixture(scope="module")
def logits(reference, prompt, generated):
    """The model's real next-token logits after the prompt and 8 greedy tokens."""
    return reference_logits(reference, prompt + generated)[-1]


def request(prompt, generated, eos=(2,), **params) -> Request:
    req = Request("r", list(prompt), SamplingParams(max_tokens=64, **params), eos_token_ids=eos)
    req.token_ids.extend(generated)
    return req


def hf(processor, prompt, generated, logits: torch.Tensor) -> torch.Tensor:
    return processor(torch.tensor([prompt + generated]), logits.clone().unsqueeze(0))[0]


def test_repetition_penalty_is_transformers(prompt, generated, logits):
    for penalty in (1.3, 0.7):
        ours = process_logits(logits.unsqueeze(0), [request(prompt, generated, repetition_penalty=penalty)])[0]
        assert torch.equal(ours, hf(RepetitionPenaltyLogitsProcessor(penalty), prompt, generated, logits))
        assert not torch.equal(ours, logits)


def test_presence_and_frequency_penalties_are_openai_formula(prompt, generated, logits):
    assert len(set(generated)) < len(generated), "the test wants a repeated token"
    ours = process_logits(
        logits.unsqueeze(0), [request(prompt, generated, presence_penalty=0.6, frequency_penalty=1.1)]
    )[0]
    want = hf(OpenAIPenalties(len(prompt), 0.6, 1.1), prompt, generated, logits)
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-6)
    prompt_only = set(prompt) - set(generated)
    assert all(ours[t] == logits[t] for t in prompt_only)  # the prompt is not penalized


def test_logit_bias_is_sequence_bias_and_clamped(prompt, generated, logits):
    bias = {5: 3.5, 17: -250.0, 40: 100.0}
    ours = process_logits(logits.unsqueeze(0), [request(prompt, generated, logit_bias=bias)])[0]
    clamped = [[[5], 3.5], [[17], -100.0], [[40], 100.0]]
    assert torch.equal(ours, hf(SequenceBiasLogitsProcessor(clamped), prompt, generated, logits))


def test_min_tokens_is_min_new_tokens(prompt, generated, logits):
    stops = [2, 9]  # eos and a stop token id
    for min_tokens in (len(generated) + 1, len(generated)):
        req = request(prompt, generated, min_tokens=min_tokens, stop_token_ids=(9,))
        ours = process_logits(logits.unsqueeze(0), [req])[0]
        want = hf(MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, stops), prompt, generated, logits)
        assert torch.equal(ours, want)
    assert torch.isinf(process_logits(logits.unsqueeze(0), [request(prompt, generated, min_tokens=9)])[0][2])
    near = process_logits(logits.unsqueeze(0), [request(prompt, generated, min_tokens=9, stop_token_ids=(9,))])[0]
    far = process_logits(logits.unsqueeze(0), [request(prompt, generated, min_tokens=9, stop_token_ids=(9, 10**6))])[0]
    assert torch.equal(far, near) and torch.isinf(far[9])  # a stop id past the vocabulary is no error
    # ignore_eos: eos may come anyway, so only the stop token ids are held back
    held = process_logits(logits.unsqueeze(0), [request(prompt, generated, min_tokens=9, ignore_eos=True, stop_token_ids=(9,))])[0]
    assert held[2] == logits[2] and torch.isinf(held[9])


def test_min_p_is_transformers_after_temperature(prompt, generated, logits):
    for min_p in (0.01, 0.1):
        req = request(prompt, generated, temperature=2.0, min_p=min_p)
        ours = filtered_scores(logits, req)
        want = MinPLogitsWarper(min_p)(torch.tensor([prompt]), (logits / 2.0).unsqueeze(0))[0]
        assert torch.equal(torch.isinf(ours), torch.isinf(want))
        assert torch.equal(ours[~torch.isinf(ours)], want[~torch.isinf(want)])
        assert 1 < int((~torch.isinf(ours)).sum()) < logits.numel()


def test_batched_rows_each_as_alone_and_plain_rows_untouched(prompt, generated, logits):
    reqs = [
        request(prompt, generated),
        request(prompt, generated, repetition_penalty=1.2, logit_bias={3: 2.0}),
        request(prompt, generated[:3], frequency_penalty=0.5, min_tokens=4),
        request(prompt, [], presence_penalty=-0.5, repetition_penalty=0.9),
    ]
    batch = torch.stack([logits] * 4)
    out = process_logits(batch, reqs)
    assert torch.equal(out[0], logits)
    for row, req in enumerate(reqs[1:], 1):
        assert torch.equal(out[row], process_logits(logits.unsqueeze(0), [req])[0])
    plain = torch.stack([logits] * 2)
    assert process_logits(plain, reqs[:1] * 2) is plain  # the plain path does no work


def test_a_bad_row_fails_alone(prompt, generated, logits):
    bad = request(prompt, generated, logit_bias={10**6: 1.0})  # past the vocabulary
    good = request(prompt, generated, logit_bias={7: 100.0})
    chosen = sample_rows(torch.stack([logits] * 3), [good, bad, request(prompt, generated)])
    assert chosen[0] == 7 and isinstance(chosen[1], Exception) and chosen[2] == int(logits.argmax())


@torch.inference_mode()
def reference_processed_greedy(model, prompt: list[int], processors: LogitsProcessorList, n: int, stop: set[int]) -> list[int]:
    """transformers' forward on the whole sequence each step, its processors, the argmax."""
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(n):
        ids = torch.tensor([tokens])
        scores = processors(ids, model(ids).logits[:, -1].float())
        token = int(scores[0].argmax())
        out.append(token)
        tokens.append(token)
        if token in stop:
            break
    return out


CASES = {
    "repetition": dict(repetition_penalty=1.5),
    "openai": dict(presence_penalty=1.0, frequency_penalty=0.8),
    "bias": dict(logit_bias={11: 4.0, 506: -100.0}),  # 506: a token the plain greedy output repeats
    "all": dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5, logit_bias={11: 2.0}),
}


def hf_processors(prompt: list[int], params: SamplingParams, eos: tuple[int, ...]) -> LogitsProcessorList:
    """The same processing from transformers' processors, in vLLM's order."""
    procs: list[LogitsProcessor] = []
    if params.logit_bias:
        procs.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias.items()]))
    if params.min_tokens:
        stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos))
        procs.append(MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, stops))
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        procs.append(OpenAIPenalties(len(prompt), params.presence_penalty, params.frequency_penalty))
    return LogitsProcessorList(procs)


@pytest.mark.parametrize("case", CASES)
def test_greedy_equals_transformers_loop(engine, reference, prompt, case):
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, **CASES[case])
    want = reference_processed_greedy(reference, prompt, hf_processors(prompt, params, ()), NEW_TOKENS, set())
    [plain] = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    [out] = engine.generate([prompt], params)
    assert out.new_token_ids == want
    assert want != plain.new_token_ids  # the option changed the output


def test_greedy_batch_of_mixed_options_equals_transformers(engine, reference, prompt):
    other = engine.tokenizer.encode("Cooking pasta needs")
    params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, **CASES[c]) for c in ("repetition", "openai")]
    params.append(SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    prompts = [prompt, other, prompt]
    outs = engine.generate(prompts, params)
    for p, sp, out in zip(prompts, params, outs):
        assert out.new_token_ids == reference_processed_greedy(reference, p, hf_processors(p, sp, ()), NEW_TOKENS, set())


def test_min_tokens_holds_eos_back(engine, reference, prompt):
    eos = engine.eos_token_ids
    forced = {eos[0]: 100.0}
    [early] = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, logit_bias=forced))
    assert early.new_token_ids == [eos[0]] and early.finish_reason is FinishReason.STOP
    params = SamplingParams(max_tokens=NEW_TOKENS, logit_bias=forced, min_tokens=5)
    [out] = engine.generate([prompt], params)
    want = reference_processed_greedy(reference, prompt, hf_processors(prompt, params, eos), NEW_TOKENS, set(eos))
    assert out.new_token_ids == want
    assert len(want) == 6 and want[-1] == eos[0] and eos[0] not in want[:5]
    assert out.finish_reason is FinishReason.STOP


def test_min_tokens_holds_stop_token_ids_back(engine, prompt):
    [plain] = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    stop = plain.new_token_ids[1]
    [out] = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, stop_token_ids=(stop,), min_tokens=4))
    assert stop not in out.new_token_ids[:3]


def test_seeded_sampling_with_options_reproducible(engine, prompt):
    opts = dict(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True, min_p=0.05)
    a = engine.generate([prompt], SamplingParams(repetition_penalty=1.4, frequency_penalty=0.5, **opts))
    b = engine.generate([prompt], SamplingParams(repetition_penalty=1.4, frequency_penalty=0.5, **opts))
    c = engine.generate([prompt], SamplingParams(**opts))
    assert a[0].new_token_ids == b[0].new_token_ids
    assert a[0].new_token_ids != c[0].new_token_ids


@pytest.mark.parametrize(
    "bad",
    [
        dict(presence_penalty=2.5),
        dict(frequency_penalty=float("nan")),
        dict(repetition_penalty=0.0),
        dict(repetition_penalty=float("inf")),
        dict(min_p=1.5),
        dict(min_tokens=-1),
        dict(min_tokens=20, max_tokens=10),
        dict(logit_bias={-1: 1.0}),
    ],
)
def test_bad_values_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_engine_refuses_logit_bias_past_vocabulary(engine, prompt):
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("big-bias", prompt, SamplingParams(logit_bias={engine.model_config.vocab_size: 1.0}))


def test_spec_round_trip_and_old_payloads():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, logit_bias={3: 1.5}, min_p=0.1, min_tokens=2)
    spec = SamplingSpec.from_params(params)
    assert SamplingSpec.decode(spec.encode()).to_params() == params
    plain = SamplingSpec(temperature=0.5).encode()
    assert b"penalty" not in plain and b"logit_bias" not in plain  # the wire a plain request had
    old = b'{"temperature":0.5,"top_p":1.0,"top_k":0,"seed":null,"max_tokens":16,"stop":[],"stop_token_ids":[],"ignore_eos":false}'
    assert SamplingSpec.decode(old).to_params() == SamplingParams(temperature=0.5)
    for bad in ('{"min_p": 2}', '{"repetition_penalty": 0}', '{"presence_penalty": -3}', '{"logit_bias": {"-1": 1}}', '{"min_tokens": -1}'):
        with pytest.raises(ValueError):
            SamplingSpec.decode(bad.encode())


@pytest.mark.parametrize("k", [1, 3])
def test_a_resumed_request_continues_as_if_uninterrupted(engine, prompt, k):
    """A retry's prompt ends with the tokens already sent; counted as generated
    (``prior_output_tokens``), the penalties and min_tokens go on as before the fault."""
    eos = engine.eos_token_ids[0]
    opts = dict(presence_penalty=0.8, frequency_penalty=0.6, logit_bias={eos: 100.0}, min_tokens=6)
    [whole] = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, **opts))
    assert len(whole.new_token_ids) == 7 and whole.new_token_ids[-1] == eos
    sent = whole.new_token_ids[:k]
    resumed = SamplingParams(max_tokens=NEW_TOKENS - k, prior_output_tokens=k, **opts)
    [rest] = engine.generate([prompt + sent], resumed)
    assert rest.new_token_ids == whole.new_token_ids[k:]
    [naive] = engine.generate([prompt + sent], SamplingParams(max_tokens=NEW_TOKENS - k, **opts))
    assert naive.new_token_ids != rest.new_token_ids  # without it the retry answers otherwise


def test_stop_strings_wait_for_min_tokens(engine, prompt):
    [plain] = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    pieces = [engine.tokenizer.decode(plain.new_token_ids[: i + 1]) for i in range(NEW_TOKENS)]
    stop = pieces[1][-2:]  # ends within the second token's text
    assert stop and stop not in pieces[0]
    [early] = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, stop=(stop,)))
    assert len(early.new_token_ids) == 2
    [held] = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, stop=(stop,), min_tokens=5))
    assert len(held.new_token_ids) > 5
    assert held.new_token_ids[:5] == plain.new_token_ids[:5]
