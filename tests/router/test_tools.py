"""The router's structured output and tool calling against a scripted backend: the grammar each
request sends, the 400s naming the field, tools in the prompt (the Hermes fallback for a
template without tools), tool calls parsed into ``message.tool_calls`` and streamed as
``delta.tool_calls`` chunks, and tool calls / tool messages in the history."""

from __future__ import annotations

import json

import asyncio
import time

import httpx
import pytest

from kvmesh.engine.structured import GrammarError, GuidedDecoding, check_guided
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.protocol import GuidedSpec
from kvmesh.services.router.openai_api import ChatCompletionRequest
from kvmesh.services.router.app import create_app
from kvmesh.services.router.tools import MAX_TOOLS, MAX_TOOLS_SCHEMA_CHARS, render_messages, template_has_tools
from tests.router.fakes import Emit, FakeBackend, Finish
from tests.router.test_app import MODEL
from tests.router.test_streaming import sse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def fake(tokenizer) -> FakeBackend:
    return FakeBackend(tokenizer, max_model_len=4096)


def answer(fake: FakeBackend, *texts: str, reason: str = "stop") -> None:
    fake.script = [*(Emit((5,), t) for t in texts), Finish(reason)]


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("fields", "kind", "value"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}}, "json_schema", SCHEMA),
        ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
        ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
        ({"response_format": {"type": "text"}}, None, None),
    ],
)
async def test_structured_output_fields_become_the_grammar(
    client: httpx.AsyncClient, fake: FakeBackend, fields: dict, kind: str | None, value: object
) -> None:
    for path, payload in [(CHAT, {"messages": USER}), (COMPLETIONS, {"prompt": "Hi"})]:
        fake.calls.clear()
        resp = await client.post(path, json={"model": MODEL, **payload, **fields})
        assert resp.status_code == 200, resp.json()
        guided = fake.calls[0].sampling.guided
        if kind is None:
            assert guided is None
            continue
        assert isinstance(guided, GuidedSpec) and guided.kind == kind
        decoded = guided.value if kind in ("regex", "json_object") else json.loads(guided.value)
        assert decoded == value


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "response_format", "Invalid type: strin"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}}, "response_format", 'Unimplemented keys: ["not"]'),
        (  # compiles, but no instance ends (it answered "" with finish_reason stop)
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}},
            "response_format",
            "no finite instance",
        ),
        (  # it failed mid-stream, the parser's item limit
            {"guided_json": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}},
            "guided_json",
            "no finite instance",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}}}]},
            "tools",
            "no finite instance",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a \"json_schema\" object"),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format.type must be"),
        ({"guided_regex": "(a"}, "guided_regex", "unclosed group"),
        ({"guided_json": "{not json"}, "guided_json", "is not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, None, "only one of"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, None, "cannot be combined"),
        ({"tool_choice": "required"}, None, "only allowed when tools are given"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "not among the tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]}, "tools", "tools[0].function.parameters"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "only tools of type 'function'"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice", "tool_choice must be"),
    ],
)
async def test_what_cannot_be_enforced_is_a_400_naming_the_field(
    client: httpx.AsyncClient, fake: FakeBackend, fields: dict, param: str | None, message: str
) -> None:
    resp = await client.post(CHAT, json={"model": MODEL, "messages": USER, **fields})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    assert fake.calls == []


async def test_tools_reach_the_prompt_in_the_fallback_format(client: httpx.AsyncClient, fake: FakeBackend, tokenizer) -> None:
    resp = await client.post(CHAT, json={"model": MODEL, "messages": USER, "tools": [WEATHER]})
    assert resp.status_code == 200
    prompt = tokenizer.decode(fake.calls[0].prompt_token_ids, skip_special_tokens=False)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in prompt
    assert prompt.startswith("<|im_start|>system\nYou are a function calling AI model.")
    assert fake.calls[0].sampling.guided is None  # auto: the text is parsed, not constrained


async def test_auto_parses_tool_calls_from_the_text(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    answer(fake, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    resp = await client.post(CHAT, json={"model": MODEL, "messages": USER, "tools": [WEATHER, TIME]})
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


async def test_auto_without_a_call_is_plain_text(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    answer(fake, "It is sunny. <tool_call>{not json}</tool_call>")
    resp = await client.post(CHAT, json={"model": MODEL, "messages": USER, "tools": [WEATHER]})
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "It is sunny. <tool_call>{not json}</tool_call>"}


async def test_parallel_tool_calls_false_keeps_the_first(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    two = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    answer(fake, two)
    for parallel, names in [(True, ["get_time", "get_weather"]), (False, ["get_time"])]:
        resp = await client.post(
            CHAT, json={"model": MODEL, "messages": USER, "tools": [WEATHER, TIME], "parallel_tool_calls": parallel}
        )
        message = resp.json()["choices"][0]["message"]
        assert [c["function"]["name"] for c in message["tool_calls"]] == names
        assert message["content"] is None
        assert len({c["id"] for c in message["tool_calls"]}) == len(names)


async def test_required_is_constrained_to_a_list_of_calls(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    answer(fake, '[{"name": "get_weather", ', '"arguments": {"city": "Rome"}}]')
    resp = await client.post(
        CHAT, json={"model": MODEL, "messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    )
    guided = fake.calls[0].sampling.guided
    assert guided is not None and guided.kind == "json_schema"
    schema = json.loads(guided.value)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [item["properties"]["name"] for item in schema["items"]["anyOf"]] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert schema["items"]["anyOf"][0]["properties"]["arguments"] == {"$ref": "#/$defs/tool_0"}
    assert schema["$defs"]["tool_0"] == WEATHER["function"]["parameters"]
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


async def test_a_named_function_is_constrained_to_its_arguments(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    answer(fake, '{"city": ', '"Lima"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = await client.post(CHAT, json={"model": MODEL, "messages": USER, "tools": [WEATHER, TIME], "tool_choice": named})
    guided = fake.calls[0].sampling.guided
    assert guided is not None and json.loads(guided.value) == WEATHER["function"]["parameters"]
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Lima"}'}


async def test_none_answers_text(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    answer(fake, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    resp = await client.post(CHAT, json={"model": MODEL, "messages": USER, "tools": [TIME], "tool_choice": "none"})
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert fake.calls[0].sampling.guided is None


def tool_deltas(events: list) -> tuple[list[dict], list[str | None]]:
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    return deltas, [c["choices"][0]["finish_reason"] for c in chunks]


def accumulate(deltas: list[dict]) -> dict[int, dict]:
    """What the openai client's stream helpers do: the id, name and argument fragments of each call."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
        call["id"] = d.get("id") or call["id"]
        call["name"] += d.get("function", {}).get("name", "")
        call["arguments"] += d.get("function", {}).get("arguments", "")
    return calls


async def test_streamed_named_arguments_come_parsed_at_the_end(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    answer(fake, '{"city": ', '"Lima"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, events = await sse(client, CHAT, {"model": MODEL, "messages": USER, "tools": [WEATHER], "tool_choice": named, "stream": True})
    deltas, reasons = tool_deltas(events)
    assert len(deltas) == 2 and deltas[0]["id"].startswith("call_") and deltas[0]["type"] == "function"
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and "id" not in deltas[1]
    assert accumulate(deltas) == {0: {"id": deltas[0]["id"], "name": "get_weather", "arguments": '{"city": "Lima"}'}}
    assert reasons[-1] == "tool_calls" and events[-1] == "[DONE]"


async def test_streamed_auto_calls_come_parsed_at_the_end(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    answer(fake, "Sure.<tool_", 'call>{"name": "get_time", "arguments": {}}</tool_call>', '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    _, events = await sse(client, CHAT, {"model": MODEL, "messages": USER, "tools": [WEATHER, TIME], "stream": True})
    deltas, reasons = tool_deltas(events)
    calls = accumulate(deltas)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    contents = [e["choices"][0]["delta"].get("content") for e in events if isinstance(e, dict) and e.get("choices")]
    assert "".join(c for c in contents if c) == "Sure."
    assert reasons[-1] == "tool_calls"


async def test_tool_calls_and_tool_messages_in_the_history(client: httpx.AsyncClient, fake: FakeBackend, tokenizer) -> None:
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    answer(fake, "It is 21 degrees.")
    resp = await client.post(CHAT, json={"model": MODEL, "messages": history, "tools": [WEATHER]})
    assert resp.status_code == 200, resp.json()
    assert resp.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is 21 degrees."}
    prompt = tokenizer.decode(fake.calls[0].prompt_token_ids, skip_special_tokens=False)
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in prompt


@pytest.mark.parametrize(
    ("message", "text"),
    [
        ({"role": "user", "content": None}, "content may be null only"),
        ({"role": "tool", "content": "x"}, "needs its tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "only assistant"),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}, "tool_calls[0] must be"),
    ],
)
async def test_malformed_tool_messages_are_400(client: httpx.AsyncClient, message: dict, text: str) -> None:
    resp = await client.post(CHAT, json={"model": MODEL, "messages": [message]})
    assert resp.status_code == 400 and text in resp.json()["error"]["message"]


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL:{{ c['function']['name'] }}"
    "{% for k, v in c['function']['arguments'].items() %} {{ k }}={{ v }}{% endfor %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_a_tool_format_gets_the_tools_itself(tokenizer) -> None:
    assert template_has_tools(TOOL_TEMPLATE) and not template_has_tools(tokenizer.chat_template)
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    request = ChatCompletionRequest.model_validate({"model": MODEL, "messages": history, "tools": [WEATHER]})
    messages, extra = render_messages(request.template_messages(), request.tool_set, TOOL_TEMPLATE)
    assert extra == {"tools": [WEATHER]}
    # the arguments as a JSON value, as vLLM gives them to a template (it iterates over them here)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    templated = Tokenizer(tokenizer.backend, chat_template=TOOL_TEMPLATE)
    text = templated.apply_chat_template(messages, add_generation_prompt=True, **extra)
    assert text.startswith("<|im_start|>system\nTOOLS:" + json.dumps([WEATHER]))
    assert "CALL:get_weather city=Oslo" in text and "<|im_start|>tool\nsunny" in text


async def test_streamed_auto_content_comes_as_it_is_generated(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    """Content streams chunk by chunk; only a tail that may become ``<tool_call>`` waits."""
    answer(fake, "It is ", "sunny <", "b>today</b>", " <tool", "_call>{bad}</tool_call>")
    _, events = await sse(client, CHAT, {"model": MODEL, "messages": USER, "tools": [WEATHER], "stream": True})
    chunks = [e["choices"][0] for e in events if isinstance(e, dict) and e.get("choices")]
    contents = [c["delta"]["content"] for c in chunks if c["delta"].get("content")]
    assert contents == ["It is", " sunny", " <b>today</b>", " <tool_call>{bad}</tool_call>"]  # trailing whitespace waits
    assert not any(c["delta"].get("tool_calls") for c in chunks) and chunks[-1]["finish_reason"] == "stop"


CITY = {
    "type": "function",
    "function": {
        "name": "find_city",
        "parameters": {
            "type": "object",
            "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
            "properties": {"city": {"$ref": "#/$defs/City"}, "near": {"$ref": "#/properties/city"}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "find_city"}}])
async def test_tool_schemas_with_refs_make_a_grammar_that_compiles(
    client: httpx.AsyncClient, fake: FakeBackend, choice: str | dict
) -> None:
    """Each tool's ``$defs`` and ``$ref``s survive being combined: the grammar the engine gets compiles."""
    answer(fake, '[{"name": "find_city", "arguments": {"city": {"name": "Oslo"}}}]' if choice == "required" else '{"city": {"name": "Oslo"}}')
    resp = await client.post(CHAT, json={"model": MODEL, "messages": USER, "tools": [WEATHER, CITY], "tool_choice": choice})
    assert resp.status_code == 200, resp.json()
    guided = fake.calls[0].sampling.guided
    assert guided is not None
    check_guided(GuidedDecoding(guided.kind, guided.value))  # raised "Pointer '/$defs/City' does not exist" before
    if choice == "required":
        schema = json.loads(guided.value)
        assert schema["$defs"]["tool_1__City"] == CITY["function"]["parameters"]["$defs"]["City"]
        assert schema["$defs"]["tool_1"]["properties"] == {"city": {"$ref": "#/$defs/tool_1__City"}, "near": {"$ref": "#/$defs/tool_1/properties/city"}}
    [call] = resp.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": {"name": "Oslo"}}


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema, "b": {"anyOf": [schema, {"type": "integer"}]}}, "required": ["a"]}
    return schema


async def test_many_large_tool_schemas_are_refused_without_stalling_the_loop(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    """128 tools of a 27 kB schema each compiled on the event loop for 7 s; now their total size is capped first."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": nested_schema(8)}} for i in range(MAX_TOOLS)]
    raw = json.dumps({"model": MODEL, "messages": USER, "tools": tools, "tool_choice": "none"}).encode()
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:  # the gap that ends with the answer counts too
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            if done.is_set():
                return

    task = asyncio.create_task(ticker())
    resp = await client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    done.set()
    await task
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "tools" and f"at most {MAX_TOOLS_SCHEMA_CHARS} characters together" in error["message"]
    assert max(gaps) < 3.0  # the body's JSON parse remains (about 0.5 s on a loaded machine)
    assert fake.calls == []


async def test_the_tools_count_in_the_prompt_size_check(tokenizer) -> None:
    """A prompt that is small but whose tools' JSON cannot fit the context is refused before templating."""
    fake = FakeBackend(tokenizer, max_model_len=64)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(fake)), base_url="http://test") as c:
        big = {"type": "function", "function": {"name": "f", "description": "x" * 2000}}
        resp = await c.post(CHAT, json={"model": MODEL, "messages": USER, "tools": [big]})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    assert "characters, more than that context can hold" in resp.json()["error"]["message"]
    assert fake.calls == []


def test_a_grammar_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check's verdict is cached by (kind, value): the Responses path's second look costs nothing."""
    import kvmesh.engine.structured as structured

    calls = []
    real = structured.grammar_of
    monkeypatch.setattr(structured, "grammar_of", lambda spec: calls.append(spec) or real(spec))
    spec = GuidedDecoding("regex", "cached-[0-9]{3}")
    bad = GuidedDecoding("regex", "cached-(")
    for _ in range(3):
        check_guided(spec)
        with pytest.raises(GrammarError):
            check_guided(bad)
    assert calls == [spec, bad]


@pytest.mark.parametrize(
    "fields",
    [
        {"guided_choice": ["yes"]},
        {"response_format": {"type": "json_object"}},
        {"tools": [WEATHER], "tool_choice": "required"},
    ],
)
async def test_ignore_eos_with_a_grammar_is_refused_by_name(client: httpx.AsyncClient, fake: FakeBackend, fields: dict) -> None:
    resp = await client.post(CHAT, json={"model": MODEL, "messages": USER, "ignore_eos": True, **fields})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "ignore_eos" and "ignore_eos cannot be combined" in resp.json()["error"]["message"]
    assert fake.calls == []


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": NAMED, "stop": ["}"]}, "stop"),
        ({"tool_choice": "required", "stop": "x"}, "stop"),
        ({"tool_choice": "required", "stop_token_ids": [5]}, "stop_token_ids"),
        ({"tool_choice": NAMED, "stop_token_ids": [5]}, "stop_token_ids"),
    ],
)
async def test_stop_with_a_forced_tool_call_is_refused_by_name(client: httpx.AsyncClient, fake: FakeBackend, fields: dict, param: str) -> None:
    """A stop string or token would cut the arguments mid-JSON, reported as a tool call."""
    resp = await client.post(CHAT, json={"model": MODEL, "messages": USER, "tools": [WEATHER], **fields})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == param and "cannot be combined with tool_choice" in resp.json()["error"]["message"]
    assert fake.calls == []


@pytest.mark.parametrize("stream", [False, True])
async def test_named_arguments_cut_short_are_content_not_a_call(client: httpx.AsyncClient, fake: FakeBackend, stream: bool) -> None:
    answer(fake, '{"city": ', '"Li', reason="length")
    body = {"model": MODEL, "messages": USER, "tools": [WEATHER], "tool_choice": NAMED, "stream": stream}
    if not stream:
        choice = (await client.post(CHAT, json=body)).json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["message"] == {"role": "assistant", "content": '{"city": "Li'}
        return
    _, events = await sse(client, CHAT, body)
    deltas, reasons = tool_deltas(events)
    assert reasons[-1] == "length"
    assert deltas == []  # no call whose arguments do not parse (its fragments had been streamed as they came)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if isinstance(e, dict) and e.get("choices"))
    assert streamed == '{"city": "Li'


async def test_named_arguments_are_the_same_string_streamed_or_not(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    texts = ('{"city":  ', '"Lima" }')  # whitespace json.dumps would not write
    answer(fake, *texts)
    body = {"model": MODEL, "messages": USER, "tools": [WEATHER], "tool_choice": NAMED}
    [call] = (await client.post(CHAT, json=body)).json()["choices"][0]["message"]["tool_calls"]
    answer(fake, *texts)
    _, events = await sse(client, CHAT, {**body, "stream": True})
    deltas, _ = tool_deltas(events)
    assert call["function"]["arguments"] == accumulate(deltas)[0]["arguments"] == "".join(texts)


async def test_auto_arguments_written_as_json_text_are_decoded_once(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    answer(fake, '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>')
    resp = await client.post(CHAT, json={"model": MODEL, "messages": USER, "tools": [WEATHER]})
    [call] = resp.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["arguments"] == '{"city": "Oslo"}'


async def test_a_strict_tools_arguments_must_validate_in_auto(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    """strict is not grammar-enforced with auto: a call whose arguments break the schema is text."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    bad = '<tool_call>{"name": "get_weather", "arguments": {"town": "Oslo"}}</tool_call>'
    good = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    answer(fake, "Checking. " + bad + good)
    choice = (await client.post(CHAT, json={"model": MODEL, "messages": USER, "tools": [strict]})).json()["choices"][0]
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [{"city": "Oslo"}]
    assert choice["message"]["content"] == "Checking. " + bad and choice["finish_reason"] == "tool_calls"
    answer(fake, bad)  # not strict: the call as the model wrote it
    choice = (await client.post(CHAT, json={"model": MODEL, "messages": USER, "tools": [WEATHER]})).json()["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"town": "Oslo"}'


@pytest.mark.parametrize(
    "texts",
    [
        ("Let me check.\n", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
        ("Two:  \n", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n', " done. "),
        ("Hi ", "there  ", "\n"),
    ],
)
async def test_auto_content_is_the_same_streamed_or_not(client: httpx.AsyncClient, fake: FakeBackend, texts: tuple) -> None:
    body = {"model": MODEL, "messages": USER, "tools": [WEATHER, TIME]}
    answer(fake, *texts)
    message = (await client.post(CHAT, json=body)).json()["choices"][0]["message"]
    answer(fake, *texts)
    _, events = await sse(client, CHAT, {**body, "stream": True})
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if isinstance(e, dict) and e.get("choices"))
    assert streamed == (message["content"] or "")
