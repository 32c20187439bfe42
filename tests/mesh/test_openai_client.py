"""The official ``openai`` client (sync, async, streaming) against a running mesh (a prefill and a
decode worker on SmolLM2): penalties, logit bias, min_p and min_tokens change the answer exactly
as they change the in-process engine's, a list of prompts is a choice each, and what kvmesh does
not implement is refused by name."""

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
