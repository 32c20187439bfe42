"""The official ``openai`` client (sync, async, streaming) against a running mesh (a prefill and a
decode worker on SmolLM2): penalties, logit bias, min_p and min_tokens change the answer exactly
as they change the in-process engine's, a list of prompts is a choice each, logprobs (chat, and
completions' with echo) equal transformers' within float tolerance, ``n`` choices are equal when
greedy and reproducible and distinct when seeded, and what kvmesh does not implement is refused
by name."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import SamplingParams
from kvmesh.infra.local_mesh import LocalMesh
from tests.mesh.meshes import MODEL, assert_pools_at_baseline

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of France is"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def engine(default_model_dir) -> LLMEngine:
    """The reference: one process, the same model and options."""
    return LLMEngine(EngineConfig(model=str(default_model_dir), served_model_name=MODEL, kv_cache_bytes=32 * 2**20))


@pytest.fixture(scope="module")
def client(mesh: LocalMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def async_client(mesh: LocalMesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def in_process(engine: LLMEngine, prompt: str | list[int], **params) -> tuple[str, list[int]]:
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    [out] = engine.generate([ids], SamplingParams(**params))
    return out.text, out.new_token_ids


def chat_ids(engine: LLMEngine, content: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_repetition_penalty_greedy_equals_the_engine(client: openai.OpenAI, engine: LLMEngine) -> None:
    plain, _ = in_process(engine, PROMPT, max_tokens=NEW_TOKENS, ignore_eos=True)
    want, _ = in_process(engine, PROMPT, max_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.5)
    assert want != plain  # the penalty matters for this prompt
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"repetition_penalty": 1.5, "ignore_eos": True},
    )
    assert got.choices[0].text == want
    assert got.usage.completion_tokens == NEW_TOKENS


def test_presence_and_frequency_penalties_equal_the_engine(client: openai.OpenAI, engine: LLMEngine) -> None:
    question = "List the days of the week, then list them again."
    ids = chat_ids(engine, question)
    plain, _ = in_process(engine, ids, max_tokens=24)
    want, _ = in_process(engine, ids, max_tokens=24, presence_penalty=1.0, frequency_penalty=1.5)
    assert want != plain
    got = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=24,
        temperature=0,
        presence_penalty=1.0,
        frequency_penalty=1.5,
    )
    assert got.choices[0].message.content == want


def test_logit_bias_forces_a_token_even_when_sampling(client: openai.OpenAI, engine: LLMEngine) -> None:
    [token] = engine.tokenizer.encode(" banana")[-1:]
    for temperature in (0.0, 1.0):
        got = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=temperature, seed=3, logit_bias={str(token): 100}
        )
        assert got.choices[0].text == engine.tokenizer.decode([token] * 5)
        assert (got.usage.completion_tokens, got.choices[0].finish_reason) == (5, "length")


def test_min_tokens_holds_the_end_back(client: openai.OpenAI, engine: LLMEngine) -> None:
    eos = engine.eos_token_ids[0]
    bias = {str(eos): 100}
    early = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias=bias)
    assert (early.choices[0].text, early.usage.completion_tokens, early.choices[0].finish_reason) == ("", 1, "stop")
    want, want_ids = in_process(engine, PROMPT, max_tokens=8, logit_bias={eos: 100.0}, min_tokens=4)
    assert len(want_ids) == 5 and want_ids[-1] == eos
    got = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias=bias, extra_body={"min_tokens": 4}
    )
    assert (got.choices[0].text, got.usage.completion_tokens, got.choices[0].finish_reason) == (want, 5, "stop")


def test_seeded_sampling_with_options_is_reproducible(client: openai.OpenAI) -> None:
    def run() -> str:
        got = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0.9,
            seed=7,
            frequency_penalty=0.5,
            extra_body={"min_p": 0.05, "repetition_penalty": 1.2},
        )
        return got.choices[0].text

    assert run() == run()


PROMPTS = ["The capital of Italy is", "Water boils at", "One, two, three,"]


def test_a_list_of_prompts_is_a_choice_each(client: openai.OpenAI, engine: LLMEngine) -> None:
    want = [in_process(engine, p, max_tokens=8, ignore_eos=True)[0] for p in PROMPTS]
    got = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == want
    assert got.usage.completion_tokens == 24
    assert got.usage.prompt_tokens == sum(len(engine.tokenizer.encode(p)) for p in PROMPTS)
    one = client.completions.create(model=MODEL, prompt=PROMPTS[:1], max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in one.choices] == want[:1]


def test_a_list_of_prompts_streamed(client: openai.OpenAI, engine: LLMEngine) -> None:
    want = [in_process(engine, p, max_tokens=8, ignore_eos=True)[0] for p in PROMPTS]
    texts = ["", "", ""]
    reasons: list[str | None] = [None, None, None]
    usage = None
    with client.completions.create(
        model=MODEL,
        prompt=PROMPTS,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ) as stream:
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
            usage = chunk.usage or usage
    assert texts == want
    assert reasons == ["length"] * 3
    assert usage is not None and usage.completion_tokens == 24


async def test_async_streamed_chat_with_options(async_client: openai.AsyncOpenAI, engine: LLMEngine) -> None:
    question = "Name a colour."
    [token] = engine.tokenizer.encode(" blue")[-1:]
    parts = []
    stream = await async_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "developer", "content": "Answer in one word."}, {"role": "user", "content": question}],
        max_tokens=10,
        temperature=0,
        logit_bias={str(token): 5},
        stream=True,
        extra_body={"repetition_penalty": 1.3},
    )
    async for chunk in stream:
        parts.append(chunk.choices[0].delta.content or "")
    # the developer message is the system prompt
    system = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": question}],
        add_generation_prompt=True,
    )
    want, _ = in_process(
        engine, engine.tokenizer.encode(system, add_special_tokens=False), max_tokens=10, repetition_penalty=1.3, logit_bias={token: 5.0}
    )
    assert "".join(parts) == want
    await async_client.close()


@pytest.mark.parametrize("field", ["guided_grammar", "reasoning_effort"])
def test_what_is_not_implemented_is_refused_by_name(client: openai.OpenAI, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, extra_body={field: {"type": "object"}}
        )
    assert info.value.status_code == 400
    assert info.value.body["message"] == f"unsupported parameter: {field}"
    assert info.value.body["param"] == field


def test_bad_values_are_named(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, presence_penalty=3)
    assert info.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logit_bias={"99999999": 1})
    assert info.value.body["param"] == "logit_bias"


def test_models_version_and_unknown_routes(client: openai.OpenAI, mesh: LocalMesh) -> None:
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    version = httpx.get(f"{mesh.base_url}/version", timeout=10)
    assert version.status_code == 200 and "version" in version.json()
    missing = httpx.post(f"{mesh.base_url}/v1/nothing", json={}, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Invalid URL (POST /v1/nothing)"


# --------------------------------------------------------------------------- n, logprobs, echo
LOGPROB_ATOL = 2e-3  # float32 on both sides; the mesh's batches and transformers' differ in order


@pytest.fixture(scope="module")
def reference(default_model_dir):
    from tests.engine.reference import load_reference

    return load_reference(default_model_dir)


def ref_logprobs(reference, tokens: list[int]):
    """Row p: the raw log-probabilities of the token after position p (transformers)."""
    import torch

    from tests.engine.reference import reference_logits

    return torch.log_softmax(reference_logits(reference, tokens), dim=-1)


def test_chat_logprobs_equal_the_reference(client: openai.OpenAI, engine: LLMEngine, reference) -> None:
    question = "Name three rivers."
    got = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = got.choices[0].logprobs.content
    ids = chat_ids(engine, question)
    _, want_ids = in_process(engine, ids, max_tokens=8)
    assert len(content) == len(want_ids) == got.usage.completion_tokens
    rows = ref_logprobs(reference, ids + want_ids)
    for i, (entry, token) in enumerate(zip(content, want_ids)):
        row = rows[len(ids) - 1 + i]
        text = engine.tokenizer.decode([token], skip_special_tokens=False)
        assert entry.token == text and bytes(entry.bytes) == text.encode()
        assert entry.logprob == pytest.approx(float(row[token]), abs=LOGPROB_ATOL)
        top = row.topk(3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=LOGPROB_ATOL)
        assert entry.top_logprobs[0].token == text  # greedy: the sampled token is the most likely


def test_completion_echo_with_prompt_logprobs_equals_the_reference(
    client: openai.OpenAI, engine: LLMEngine, reference
) -> None:
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True)
    ids = engine.tokenizer.encode(PROMPT)
    _, want_ids = in_process(engine, ids, max_tokens=4)
    choice = got.choices[0]
    assert choice.text == PROMPT + engine.tokenizer.decode(want_ids)
    lp = choice.logprobs
    rows = ref_logprobs(reference, ids + want_ids)
    tokens = ids + want_ids
    assert len(lp.tokens) == len(tokens) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [float(rows[i - 1][tokens[i]]) for i in range(1, len(tokens))]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=LOGPROB_ATOL)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # the top 2, and the token's own
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(tokens))]
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 4
    # streamed: the same numbers
    streamed: list[float | None] = []
    with client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True, stream=True
    ) as stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs:
                streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def cached_tokens_metric(mesh: LocalMesh) -> float:
    text = httpx.get(f"{mesh.base_url}/metrics", timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("kvmesh_router_cached_prompt_tokens_total")))


def test_n_greedy_choices_are_equal_and_the_prompt_counts_once(
    client: openai.OpenAI, engine: LLMEngine, mesh: LocalMesh
) -> None:
    prompt = "A fresh prompt, so that only its own first choice can have cached it: " + PROMPT
    want, _ = in_process(engine, prompt, max_tokens=8, ignore_eos=True)
    before = cached_tokens_metric(mesh)
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, n=4, extra_body={"ignore_eos": True}
    )
    # the three later choices reused the first's full prompt blocks from the prefill worker's cache
    num_prompt = len(engine.tokenizer.encode(prompt))
    full_blocks = (num_prompt - 1) // 16 * 16
    assert full_blocks > 0 and cached_tokens_metric(mesh) - before == 3 * full_blocks
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [want] * 4
    assert got.usage.prompt_tokens == num_prompt
    assert got.usage.completion_tokens == 32


def test_n_seeded_choices_are_reproducible_and_distinct(client: openai.OpenAI) -> None:
    def run() -> list[str]:
        got = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a line about the sea."}], max_tokens=12,
            temperature=1.0, seed=5, n=4,
        )  # fmt: skip
        return [c.message.content or "" for c in got.choices]

    first = run()
    assert run() == first
    assert len(set(first)) == 4
    with client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a line about the sea."}], max_tokens=12,
        temperature=1.0, seed=5, n=4, stream=True,
    ) as stream:  # fmt: skip
        texts = ["", "", "", ""]
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
    assert texts == first


async def test_async_streamed_chat_logprobs_with_n(async_client: openai.AsyncOpenAI, client: openai.OpenAI) -> None:
    params = {"model": MODEL, "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 6,
              "temperature": 0, "logprobs": True, "top_logprobs": 2, "n": 2}  # fmt: skip
    whole = client.chat.completions.create(**params)
    want = [[(e.token, e.logprob) for e in c.logprobs.content] for c in whole.choices]
    assert len(want[0]) == whole.usage.completion_tokens // 2
    # greedy: the same tokens; their logprobs to float noise (a sibling prefills from the cached blocks)
    assert [t for t, _ in want[0]] == [t for t, _ in want[1]]
    assert [v for _, v in want[0]] == pytest.approx([v for _, v in want[1]], abs=1e-4)
    got: list[list[tuple[str, float]]] = [[], []]
    stream = await async_client.chat.completions.create(**params, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                got[choice.index] += [(e.token, e.logprob) for e in choice.logprobs.content]
    await async_client.close()
    for streamed, answered in zip(got, want):
        assert [t for t, _ in streamed] == [t for t, _ in answered]
        assert [v for _, v in streamed] == pytest.approx([v for _, v in answered], abs=1e-4)
RESPONSES_QUESTION = "What is the capital of France?"


def test_responses_create_and_stream_give_the_chat_endpoints_greedy_text(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": RESPONSES_QUESTION}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    want = chat.choices[0].message.content
    assert want
    created = client.responses.create(
        model=MODEL, instructions="Answer briefly.", input=RESPONSES_QUESTION, max_output_tokens=12, temperature=0
    )
    assert created.output_text == want
    assert created.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (created.usage.input_tokens, created.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert created.usage.input_tokens_details.cached_tokens > 0  # the same prompt, just served
    deltas, types = [], []
    with client.responses.stream(
        model=MODEL,
        input=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": [{"type": "input_text", "text": RESPONSES_QUESTION}]}],
        max_output_tokens=12,
        temperature=0,
    ) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
    assert "".join(deltas) == want
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{created.status}",
    ]


async def test_responses_async_stream_final_response(async_client: openai.AsyncOpenAI) -> None:
    chat = await async_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=32, temperature=0
    )
    assert chat.choices[0].finish_reason == "stop"  # ends by itself, so the stream ends response.completed
    async with async_client.responses.stream(model=MODEL, input="Say hi.", max_output_tokens=32, temperature=0) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert (final.output_text, final.status) == (chat.choices[0].message.content, "completed")
    with pytest.raises(openai.BadRequestError) as info:
        await async_client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")
    assert info.value.body["param"] == "previous_response_id"
    await async_client.close()


async def test_pools_back_at_baseline(mesh: LocalMesh) -> None:
    await assert_pools_at_baseline(mesh, ["prefill-1", "decode-2"])
