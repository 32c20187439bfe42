"""Structured output and tool calling through a running mesh (a prefill and a decode worker on
SmolLM2) with the official ``openai`` client: 50 schemas whose answers always parse and
validate, streamed and not; the grammar carried from the prefill worker's first token to the
decode worker; tool calls (required, named, none, streamed deltas) that parse and match their
function's parameters."""

from __future__ import annotations

import asyncio
import json
import random
import re

import jsonschema
import openai
import pytest

from kvmesh.infra.local_mesh import LocalMesh
from tests.engine.test_structured import SCHEMAS
from tests.mesh.meshes import MODEL, assert_pools_at_baseline
from tests.mesh.meshes import TIME_TOOL as TIME, WEATHER_TOOL as WEATHER

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(mesh: LocalMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


async def test_fifty_schemas_parse_and_validate_streamed_and_not(mesh: LocalMesh) -> None:
    client = openai.AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    rng = random.Random(0)

    async def one(i: int, schema: dict) -> tuple[str, str | None]:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        messages = [{"role": "user", "content": "Give me an example JSON value."}]
        temperature = rng.choice([0.0, 0.8])
        if i % 2:
            text, reason = "", None
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=300, temperature=temperature, seed=i, response_format=fmt, stream=True  # type: ignore[arg-type]
            )
            async for chunk in stream:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
            return text, reason
        got = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=300, temperature=temperature, seed=i, response_format=fmt  # type: ignore[arg-type]
        )
        return got.choices[0].message.content or "", got.choices[0].finish_reason

    try:
        results = await asyncio.gather(*(one(i, s) for i, s in enumerate(SCHEMAS)))
    finally:
        await client.close()
    for schema, (text, reason) in zip(SCHEMAS, results):
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_regex_and_choice(client: openai.OpenAI, stream: bool) -> None:
    def ask(**fields) -> str:
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a cat."}], max_tokens=80, temperature=0)
        if not stream:
            return client.chat.completions.create(**kwargs, **fields).choices[0].message.content or ""  # type: ignore[call-overload]
        chunks = client.chat.completions.create(**kwargs, **fields, stream=True)  # type: ignore[call-overload]
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    assert isinstance(json.loads(ask(response_format={"type": "json_object"})), dict)
    # a forced first token: the prefill worker samples it under the grammar, the decode worker
    # rebuilds the matcher over it and goes on from there
    pattern = r"Verdict: (cute|grumpy|sleepy), score [1-9]/10\."
    assert re.fullmatch(pattern, ask(extra_body={"guided_regex": pattern}))
    assert ask(extra_body={"guided_choice": ["mammal", "reptile", "bird"]}) in ("mammal", "reptile", "bird")


def test_a_forced_prefix_spans_the_prefill_to_decode_hand_off(client: openai.OpenAI) -> None:
    """The first token (the prefill's) must be the literal's first piece, and every decode
    token after it must continue the literal: without the hand-off of grammar state the decode
    worker would start the literal again."""
    literal = "The answer is exactly forty-two"
    got = client.completions.create(
        model=MODEL, prompt="Q: What is six times seven?\nA:", max_tokens=40, temperature=0, extra_body={"guided_choice": [literal]}
    )
    assert (got.choices[0].text, got.choices[0].finish_reason) == (literal, "stop")
    assert got.usage is not None and got.usage.completion_tokens > 2  # prefill's token, then the decode worker's


def check_call(call, tools: list[dict]) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    [tool] = [t for t in tools if t["function"]["name"] == call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_required_tool_calls_parse(client: openai.OpenAI) -> None:
    for parallel in (True, False):
        got = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel, max_tokens=200, temperature=0  # type: ignore[list-item]
        )
        choice = got.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls and (parallel or len(choice.message.tool_calls) == 1)
        for call in choice.message.tool_calls:
            check_call(call, [WEATHER, TIME])


def test_a_named_function_streamed_and_not(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    got = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=100, temperature=0)  # type: ignore[list-item, arg-type]
    [call] = got.choices[0].message.tool_calls or []
    check_call(call, [WEATHER])
    assert got.choices[0].finish_reason == "tool_calls"
    ids, names, arguments, reasons = set(), "", "", []
    chunks = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=100, temperature=0, stream=True  # type: ignore[list-item, arg-type]
    )
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            assert delta.index == 0 and delta.function is not None
            if delta.id:
                ids.add(delta.id)
            names += delta.function.name or ""
            arguments += delta.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert len(ids) == 1 and names == "get_weather"
    assert json.loads(arguments) == json.loads(call.function.arguments)  # greedy: the same call
    assert reasons[-1] == "tool_calls"


def test_streamed_required_calls_accumulate_as_the_client_does(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200, temperature=0  # type: ignore[list-item]
    ) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    assert calls and final.choices[0].finish_reason == "tool_calls"
    for call in calls:
        check_call(call, [WEATHER, TIME])


def test_none_and_a_tool_result_in_the_history(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=16, temperature=0)  # type: ignore[list-item]
    assert not got.choices[0].message.tool_calls and got.choices[0].finish_reason in ("stop", "length")
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    got = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=24, temperature=0)  # type: ignore[arg-type, list-item]
    assert got.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert got.choices[0].message.content or got.choices[0].message.tool_calls


async def test_pools_back_at_baseline(mesh: LocalMesh) -> None:
    await assert_pools_at_baseline(mesh, ["prefill-1", "decode-2"])
