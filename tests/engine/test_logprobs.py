"""Logprobs of sampled and prompt tokens: exact (within float tolerance) against transformers'
log-softmax of the same weights' logits, across chunked prefill, batching, the prefix cache,
the export / import hand-off and a resumed request; of the raw distribution (vLLM's default)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.logprobs import PromptSpan
from kvmesh.engine.request import MAX_LOGPROBS, Request, SamplingParams, TokenLogprob
from kvmesh.protocol import LogprobSpec, PrefillResponse, SamplingSpec, TokenEvent
from tests.engine.reference import load_reference, reference_logits

ATOL = 1e-4  # float32, two implementations of the same model
K = 5


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # A small batch budget: a 21-token prompt is prefilled in three chunks.
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=256, max_num_batched_tokens=8))


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return load_reference(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.encode("The river carries water from the mountains to the sea, and the river")


def ref_logprobs(reference, tokens: list[int]) -> torch.Tensor:
    """Row p: the log-probabilities of the token after position p."""
    return torch.log_softmax(reference_logits(reference, tokens), dim=-1)


def assert_matches(value: TokenLogprob, row: torch.Tensor, token: int, k: int) -> None:
    assert value.token_id == token
    assert value.logprob == pytest.approx(float(row[token]), abs=ATOL)
    assert len(value.top) == k
    top = torch.topk(row, k)
    got_values = torch.tensor([lp for _, lp in value.top])
    torch.testing.assert_close(got_values, top.values, atol=ATOL, rtol=0)
    # ids agree except where two logprobs tie within the tolerance
    for (got_id, _), want_id, want_value in zip(value.top, top.indices.tolist(), top.values.tolist()):
        assert got_id == want_id or abs(float(row[got_id]) - want_value) < ATOL


def test_greedy_logprobs_and_top_k_are_the_references(engine, reference, prompt):
    [out] = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=K))
    rows = ref_logprobs(reference, prompt + out.new_token_ids)
    assert out.logprobs is not None and len(out.logprobs) == 6
    for i, (token, value) in enumerate(zip(out.new_token_ids, out.logprobs)):
        assert value is not None
        assert_matches(value, rows[len(prompt) - 1 + i], token, K)
        assert value.top[0][0] == token  # greedy: the sampled token is the most likely
    assert out.prompt_logprobs is None


def test_logprobs_are_of_the_raw_distribution(engine, reference, prompt):
    """Temperature, penalties and bias change what is sampled, not the logprob reported."""
    params = SamplingParams(
        max_tokens=6, ignore_eos=True, logprobs=2, temperature=0.7, seed=11,
        frequency_penalty=0.8, repetition_penalty=1.3, logit_bias={7: 5.0}, min_p=0.05,
    )  # fmt: skip
    [out] = engine.generate([prompt], params)
    rows = ref_logprobs(reference, prompt + out.new_token_ids)
    for i, (token, value) in enumerate(zip(out.new_token_ids, out.logprobs or [])):
        assert value is not None
        assert_matches(value, rows[len(prompt) - 1 + i], token, 2)


def test_prompt_logprobs_across_chunks_and_past_the_prefix_cache(engine, reference, prompt):
    plain = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate([prompt], plain)  # now the prompt's full blocks are cached
    [again] = engine.generate([prompt], plain)
    assert again.num_cached_tokens > 0
    [out] = engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True, logprobs=1, prompt_logprobs=3))
    assert out.num_cached_tokens == 0  # it needed every position's logits: no cached blocks used
    rows = ref_logprobs(reference, prompt + out.new_token_ids)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        value = out.prompt_logprobs[i]
        assert value is not None
        assert_matches(value, rows[i - 1], prompt[i], 3)
    assert_matches(out.logprobs[0], rows[len(prompt) - 1], out.new_token_ids[0], 1)  # type: ignore[index, arg-type]


def test_a_batch_of_mixed_requests_each_as_alone(engine, reference, prompt):
    prompts = [prompt, prompt[:9], prompt[3:]]
    params = [
        SamplingParams(max_tokens=3, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=3, ignore_eos=True),
        SamplingParams(max_tokens=3, ignore_eos=True, logprobs=MAX_LOGPROBS, prompt_logprobs=0),
    ]
    outs = engine.generate(prompts, params)
    assert outs[1].logprobs is None and outs[1].prompt_logprobs is None
    for ids, out, p in zip(prompts, outs, params):
        if p.logprobs is None:
            continue
        rows = ref_logprobs(reference, ids + out.new_token_ids)
        for i, (token, value) in enumerate(zip(out.new_token_ids, out.logprobs or [])):
            assert_matches(value, rows[len(ids) - 1 + i], token, p.logprobs)  # type: ignore[arg-type]
    rows = ref_logprobs(reference, prompts[2])
    got = outs[2].prompt_logprobs or []
    assert [v.token_id for v in got[1:]] == prompts[2][1:]  # type: ignore[union-attr]
    torch.testing.assert_close(
        torch.tensor([v.logprob for v in got[1:]]),  # type: ignore[union-attr]
        rows[torch.arange(len(prompts[2]) - 1), torch.tensor(prompts[2][1:])],
        atol=ATOL,
        rtol=0,
    )


def test_export_carries_the_first_logprob_and_the_import_does_not(engine, reference, prompt):
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    engine.add_request("export-lp", prompt, params, export_kv=True)
    outs = []
    while engine.has_unfinished():
        outs.extend(o for o in engine.step() if o.request_id == "export-lp")
    (last,) = [o for o in outs if o.finished]
    rows = ref_logprobs(reference, prompt + last.new_token_ids)
    assert_matches(last.logprobs[0], rows[len(prompt) - 1], last.new_token_ids[0], 2)  # type: ignore[index, arg-type]
    assert last.prompt_logprobs is not None and len(last.prompt_logprobs) == len(prompt)
    export = last.kv_export
    assert export is not None
    try:
        blocks = engine.allocate_import("import-lp", len(prompt))
        assert blocks is not None
        engine.kv_pool.tensor[list(blocks)] = engine.kv_pool.tensor[list(export.block_ids)]
        first = engine.add_imported_request("dec-lp", prompt, last.new_token_ids[0], "import-lp", params)
        assert first.logprobs == [None] and first.prompt_logprobs is None  # computed by the prefill side
        tokens, values = list(first.new_token_ids), []
        while engine.has_unfinished():
            for o in engine.step():
                tokens += o.new_token_ids
                values += o.logprobs or []
        rows = ref_logprobs(reference, prompt + tokens)
        for i, (token, value) in enumerate(zip(tokens[1:], values), start=1):
            assert_matches(value, rows[len(prompt) - 1 + i], token, 2)
    finally:
        engine.release_export("export-lp")


def test_a_resumed_request_reports_only_its_new_tokens(engine, reference, prompt):
    [whole] = engine.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1))
    done = whole.new_token_ids[:2]
    [rest] = engine.generate([prompt + done], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=1, prior_output_tokens=2))
    assert rest.new_token_ids == whole.new_token_ids[2:]
    got = [v.logprob for v in rest.logprobs or []]  # type: ignore[union-attr]
    want = [v.logprob for v in (whole.logprobs or [])[2:]]  # type: ignore[union-attr]
    assert got == pytest.approx(want, abs=ATOL)


def test_a_recomputed_chunk_is_not_recorded_twice():
    req = Request("r", [1, 2, 3, 4, 5], SamplingParams(prompt_logprobs=0))
    req.prompt_logprobs = [None, TokenLogprob(2, -1.0), TokenLogprob(3, -1.0)]  # positions 0 and 1 done
    assert PromptSpan(req, 0, 0, 4).wanted() == range(2, 4)  # after a preemption: from position 2
    assert PromptSpan(req, 0, 4, 1).wanted() == range(4, 4)  # the last position predicts no prompt token


@pytest.mark.parametrize("bad", [{"logprobs": -1}, {"logprobs": MAX_LOGPROBS + 1}, {"prompt_logprobs": 21}])
def test_bad_counts_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_wire_forms():
    assert "logprobs" not in SamplingSpec().model_dump_json()  # an old worker reads a plain request as before
    spec = SamplingSpec(logprobs=3, prompt_logprobs=0)
    assert SamplingSpec.decode(spec.encode()).to_params().prompt_logprobs == 0
    value = TokenLogprob(5, -0.25, ((5, -0.25), (9, -2.0)))
    assert LogprobSpec.from_logprob(value).to_logprob() == value
    event = TokenEvent(request_id="r", seq=0, token_ids=[5], logprobs=LogprobSpec.many([value]), prompt_logprobs=[None])
    assert TokenEvent.decode(event.encode()) == event
    assert "logprobs" not in TokenEvent(request_id="r", seq=0).model_dump_json()
    assert "first_logprob" not in PrefillResponse(request_id="r").model_dump_json()
