"""LangChain (``langchain-openai``: the chat class and the completions class) and LiteLLM's
openai-compatible provider against a running mesh: invoke and stream give the official client's
greedy text, and every option a user sets through them (n, logprobs, penalties, logit bias,
seed, stop, max_tokens, structured output, tool calling, streamed usage, a list of prompts, the
Responses API) gives what the official client gets from the same mesh for the same request:
the same text and tool arguments, parsed JSON that validates, logprobs within 1e-4. What each
library sends is recorded (an httpx hook, or the body LiteLLM logs) and checked, so that an
option it dropped cannot pass as a greedy default. Neither may reach anything but loopback:
the cost map is LiteLLM's local copy, tracing is off, and a socket guard fails the test on any
connect (or name lookup) elsewhere."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from kvmesh.infra.local_mesh import LocalMesh
from tests.mesh.meshes import MODEL, assert_pools_at_baseline
from tests.mesh.meshes import TIME_TOOL as TIME, WEATHER_TOOL as WEATHER

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
PROMPTS = ["The capital of France is", "Water boils at"]
OFFLINE_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else LiteLLM fetches its cost map at import
    "LANGCHAIN_TRACING_V2": "false",
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_CALLBACKS_BACKGROUND": "false",
}
LOOPBACK_NAMES = {"localhost", "localhost.localdomain"}


def _loopback(host: Any) -> bool:
    if isinstance(host, bytes):
        host = host.decode()
    if not isinstance(host, str):
        return False
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class NetworkGuard:
    """Refuses (and records) every connect and name lookup that is not loopback's."""

    def __init__(self) -> None:
        self.refused: list[str] = []

    def _refuse(self, what: str) -> OSError:
        self.refused.append(what)
        return OSError(f"network guard: {what} is not loopback")

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
        real_getaddrinfo = socket.getaddrinfo

        def check(sock: socket.socket, address: Any) -> None:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
                raise self._refuse(f"connect to {address!r}")

        def connect(sock: socket.socket, address: Any) -> None:
            check(sock, address)
            return real_connect(sock, address)

        def connect_ex(sock: socket.socket, address: Any) -> int:
            check(sock, address)
            return real_connect_ex(sock, address)

        def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
            if host is not None and not _loopback(host):
                raise self._refuse(f"name lookup of {host!r}")
            return real_getaddrinfo(host, *args, **kwargs)

        monkeypatch.setattr(socket.socket, "connect", connect)
        monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture(scope="module")
def guard() -> Iterator[NetworkGuard]:
    guard = NetworkGuard()
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, value in OFFLINE_ENV.items():
            monkeypatch.setenv(name, value)
        guard.install(monkeypatch)
        yield guard
    assert guard.refused == []


@pytest.fixture(autouse=True)
def no_network(guard: NetworkGuard) -> Iterator[None]:
    yield
    assert guard.refused == [], guard.refused  # something tried to leave the machine


@pytest.fixture(scope="module")
def base_url(mesh: LocalMesh, guard: NetworkGuard) -> str:
    return f"{mesh.base_url}/v1"


@pytest.fixture(scope="module")
def reference(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


def greedy_chat(reference: openai.OpenAI, max_tokens: int) -> str:
    got = reference.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=max_tokens, temperature=0
    )
    text = got.choices[0].message.content
    assert text
    return text


def test_the_guard_refuses_other_addresses(guard: NetworkGuard) -> None:
    with socket.socket() as sock, pytest.raises(OSError, match="network guard"):
        sock.connect(("192.0.2.1", 443))  # TEST-NET-1: refused before anything is sent
    with pytest.raises(OSError, match="network guard"):
        socket.getaddrinfo("example.com", 443)
    assert len(guard.refused) == 2
    guard.refused.clear()


def test_langchain_chat_invoke_and_stream(base_url: str, reference: openai.OpenAI) -> None:
    from langchain_openai import ChatOpenAI

    want = greedy_chat(reference, 16)
    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", temperature=0, max_tokens=16, max_retries=0, timeout=60)
    answer = llm.invoke(QUESTION)
    assert answer.content == want
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] >= 1
    assert "".join(str(chunk.content) for chunk in llm.stream(QUESTION)) == want


async def test_langchain_chat_async_stream(base_url: str, reference: openai.OpenAI) -> None:
    from langchain_openai import ChatOpenAI

    want = greedy_chat(reference, 16)
    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", temperature=0, max_tokens=16, max_retries=0, timeout=60)
    assert "".join([str(chunk.content) async for chunk in llm.astream(QUESTION)]) == want


def test_langchain_completions_invoke_stream_and_batch(base_url: str, reference: openai.OpenAI) -> None:
    from langchain_openai import OpenAI

    want = [
        reference.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in PROMPTS
    ]
    llm = OpenAI(model=MODEL, base_url=base_url, api_key="unused", temperature=0, max_tokens=8, max_retries=0, timeout=60)
    assert llm.invoke(PROMPTS[0]) == want[0]  # sent as prompt: ["..."]
    assert "".join(llm.stream(PROMPTS[0])) == want[0]
    result = llm.generate(PROMPTS)  # one request, a prompt each
    assert [g[0].text for g in result.generations] == want


def test_litellm_completion_and_stream(base_url: str, reference: openai.OpenAI) -> None:
    assert os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    import litellm

    litellm.telemetry = False
    want = greedy_chat(reference, 16)
    options: dict[str, Any] = {
        "model": f"openai/{MODEL}",
        "api_base": base_url,
        "api_key": "unused",
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 16,
        "num_retries": 0,
        "timeout": 60,
    }
    got = litellm.completion(**options)
    assert got.choices[0].message.content == want
    assert got.usage.completion_tokens >= 1
    parts = [chunk.choices[0].delta.content or "" for chunk in litellm.completion(**options, stream=True)]
    assert "".join(parts) == want


async def test_litellm_async_stream(base_url: str, reference: openai.OpenAI) -> None:
    import litellm

    want = greedy_chat(reference, 16)
    stream = await litellm.acompletion(
        model=f"openai/{MODEL}",
        api_base=base_url,
        api_key="unused",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=16,
        stream=True,
        num_retries=0,
        timeout=60,
    )
    parts = [chunk.choices[0].delta.content or "" async for chunk in stream]
    assert "".join(parts) == want


# --------------------------------------------------------------------------- every option
# Each test asks the official client first (the reference), then LangChain and LiteLLM the same
# request; "plain" is the reference without the option, to show that the option matters.
DAYS = "List the days of the week, then list them again."
SEA = "Write a line about the sea."
LOGPROB_ATOL = 1e-4
ASK = "What is the weather in Paris right now?"
TOOL_RESULT = '{"temperature": 21, "sky": "clear"}'


class Recorder:
    """The JSON bodies an OpenAI client sent, through an httpx hook on its own client."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def _record(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.content) if request.content else {})

    async def _arecord(self, request: httpx.Request) -> None:
        self._record(request)

    def client(self) -> httpx.Client:
        return httpx.Client(event_hooks={"request": [self._record]}, timeout=60)

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(event_hooks={"request": [self._arecord]}, timeout=60)

    @property
    def last(self) -> dict[str, Any]:
        return self.bodies[-1]


@pytest.fixture
def sent() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from kvmesh.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model_dir)


def token_id(tokenizer, text: str) -> int:
    return tokenizer.encode(text)[-1]


def chat_model(base_url: str, sent: Recorder | None = None, **options: Any):
    from langchain_openai import ChatOpenAI

    sent = sent or Recorder()  # clients of its own: LangChain's shared one outlives a test's event loop
    clients = {"http_client": sent.client(), "http_async_client": sent.async_client()}
    settings: dict[str, Any] = {"temperature": 0, "max_tokens": 16, **options}
    return ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", max_retries=0, timeout=60, **clients, **settings)


def completions_model(base_url: str, sent: Recorder | None = None, **options: Any):
    from langchain_openai import OpenAI

    sent = sent or Recorder()  # clients of its own: LangChain's shared one outlives a test's event loop
    clients = {"http_client": sent.client(), "http_async_client": sent.async_client()}
    settings: dict[str, Any] = {"temperature": 0, "max_tokens": 8, **options}
    return OpenAI(model=MODEL, base_url=base_url, api_key="unused", max_retries=0, timeout=60, **clients, **settings)


def litellm_call(base_url: str, content: str | list[dict[str, Any]], **options: Any) -> Any:
    import litellm

    litellm.telemetry = False
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    settings: dict[str, Any] = {"temperature": 0, "max_tokens": 16, **options}
    return litellm.completion(
        model=f"openai/{MODEL}", api_base=base_url, api_key="unused", messages=messages, num_retries=0, timeout=60, **settings
    )


def official_chat(reference: openai.OpenAI, content: str | list[dict[str, Any]], **options: Any) -> Any:
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    settings: dict[str, Any] = {"temperature": 0, "max_tokens": 16, **options}
    return reference.chat.completions.create(model=MODEL, messages=messages, **settings)  # type: ignore[call-overload]


# The options a user sets, each with the question it matters for (checked against "plain").
SAMPLING_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "penalties": (DAYS, {"max_tokens": 24, "presence_penalty": 1.0, "frequency_penalty": 1.5}),
    "seed": (SEA, {"max_tokens": 12, "temperature": 0.9, "seed": 7}),
    "stop": (QUESTION, {"stop": [" Paris"]}),
    "max_tokens": (QUESTION, {"max_tokens": 3}),
}


def sampling_case(name: str, tokenizer) -> tuple[str, dict[str, Any]]:
    if name == "logit_bias":  # " banana" five times over, even when sampling
        return QUESTION, {"max_tokens": 5, "temperature": 1.0, "seed": 3, "logit_bias": {str(token_id(tokenizer, " banana")): 100}}
    question, options = SAMPLING_CASES[name]
    return question, dict(options)


CASE_NAMES = [*SAMPLING_CASES, "logit_bias"]


@pytest.fixture(scope="module")
def sampling_references(reference: openai.OpenAI, tokenizer) -> dict[str, Any]:
    """Each case's answer through the official client, and that it differs from the plain one."""
    answers = {}
    for name in CASE_NAMES:
        question, options = sampling_case(name, tokenizer)
        got = official_chat(reference, question, **options)
        plain = official_chat(reference, question, max_tokens=16 if name == "max_tokens" else options.get("max_tokens", 16))
        assert got.choices[0].message.content != plain.choices[0].message.content, name  # the option matters here
        answers[name] = got.choices[0]
    assert answers["max_tokens"].finish_reason == "length"
    assert answers["stop"].finish_reason == "stop" and "Paris" not in answers["stop"].message.content
    assert answers["logit_bias"].message.content == " banana" * 5
    return answers


@pytest.mark.parametrize("case", CASE_NAMES)
def test_langchain_chat_sampling_options(base_url: str, sampling_references, tokenizer, sent: Recorder, case: str) -> None:
    question, options = sampling_case(case, tokenizer)
    want = sampling_references[case]
    stop = options.pop("stop", None)
    if "logit_bias" in options:
        options["logit_bias"] = {int(k): v for k, v in options["logit_bias"].items()}
    llm = chat_model(base_url, sent, **options)
    answer = llm.invoke(question, stop=stop)
    assert answer.content == want.message.content
    assert answer.response_metadata["finish_reason"] == want.finish_reason
    body = sent.last
    for field, value in sampling_case(case, tokenizer)[1].items():
        # sent as the official client sends it; max_tokens as its newer name
        assert body["max_completion_tokens" if field == "max_tokens" else field] == value, field
    assert "".join(str(c.content) for c in llm.stream(question, stop=stop)) == want.message.content


@pytest.mark.parametrize("case", CASE_NAMES)
def test_litellm_sampling_options(base_url: str, sampling_references, tokenizer, case: str) -> None:
    question, options = sampling_case(case, tokenizer)
    want = sampling_references[case]
    got = litellm_call(base_url, question, **options)
    assert (got.choices[0].message.content, got.choices[0].finish_reason) == (want.message.content, want.finish_reason)
    parts = [c.choices[0].delta.content or "" for c in litellm_call(base_url, question, **options, stream=True)]
    assert "".join(parts) == want.message.content


async def test_async_sampling_options_through_both(base_url: str, sampling_references, tokenizer) -> None:
    import litellm

    question, options = sampling_case("penalties", tokenizer)
    want = sampling_references["penalties"].message.content
    answer = await chat_model(base_url, **options).ainvoke(question)
    assert answer.content == want
    got = await litellm.acompletion(
        model=f"openai/{MODEL}", api_base=base_url, api_key="unused", messages=[{"role": "user", "content": question}],
        temperature=0, num_retries=0, timeout=60, **options,
    )  # fmt: skip
    assert got.choices[0].message.content == want


# --------------------------------------------------------------------------- n
N_OPTIONS: dict[str, Any] = {"max_tokens": 12, "temperature": 1.0, "seed": 5}


@pytest.fixture(scope="module")
def four_choices(reference: openai.OpenAI) -> list[str]:
    got = official_chat(reference, SEA, n=4, **N_OPTIONS)
    texts = [c.message.content or "" for c in got.choices]
    assert len(set(texts)) == 4  # seeded: distinct, and reproducible (tests/mesh/test_openai_client.py)
    return texts


def test_langchain_chat_n(base_url: str, four_choices: list[str], sent: Recorder) -> None:
    from langchain_core.messages import HumanMessage

    result = chat_model(base_url, sent, n=4, **N_OPTIONS).generate([[HumanMessage(SEA)]])
    assert sent.last["n"] == 4
    assert [g.text for g in result.generations[0]] == four_choices


def test_litellm_n(base_url: str, four_choices: list[str]) -> None:
    got = litellm_call(base_url, SEA, n=4, **N_OPTIONS)
    assert [c.message.content for c in got.choices] == four_choices
    assert [c.index for c in got.choices] == [0, 1, 2, 3]


# --------------------------------------------------------------------------- logprobs
LOGPROB_QUESTION = "Name three rivers."


def logprob_rows(content: list[Any]) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token, logprob, [(top token, logprob)]) from the chat shape, as objects or dicts."""

    def get(item: Any, key: str) -> Any:
        return item[key] if isinstance(item, dict) else getattr(item, key)

    return [(get(e, "token"), get(e, "logprob"), [(get(t, "token"), get(t, "logprob")) for t in get(e, "top_logprobs")]) for e in content]


def assert_logprobs_equal(got: list[Any], want: list[Any]) -> None:
    got_rows, want_rows = logprob_rows(got), logprob_rows(want)
    assert [r[0] for r in got_rows] == [r[0] for r in want_rows]
    assert [r[1] for r in got_rows] == pytest.approx([r[1] for r in want_rows], abs=LOGPROB_ATOL)
    for (_, _, got_top), (_, _, want_top) in zip(got_rows, want_rows):
        assert [t for t, _ in got_top] == [t for t, _ in want_top]
        assert [v for _, v in got_top] == pytest.approx([v for _, v in want_top], abs=LOGPROB_ATOL)


@pytest.fixture(scope="module")
def chat_logprobs(reference: openai.OpenAI) -> tuple[str, list[Any]]:
    got = official_chat(reference, LOGPROB_QUESTION, max_tokens=8, logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    return got.choices[0].message.content, content


def test_langchain_chat_logprobs(base_url: str, chat_logprobs, sent: Recorder) -> None:
    text, want = chat_logprobs
    llm = chat_model(base_url, sent, max_tokens=8, logprobs=True, top_logprobs=3)
    answer = llm.invoke(LOGPROB_QUESTION)
    assert (sent.last["logprobs"], sent.last["top_logprobs"]) == (True, 3)
    assert answer.content == text
    assert_logprobs_equal(answer.response_metadata["logprobs"]["content"], want)
    streamed: list[Any] = []
    for chunk in llm.stream(LOGPROB_QUESTION):
        streamed += (chunk.response_metadata.get("logprobs") or {}).get("content") or []
    assert_logprobs_equal(streamed, want)


def test_litellm_logprobs(base_url: str, chat_logprobs) -> None:
    text, want = chat_logprobs
    got = litellm_call(base_url, LOGPROB_QUESTION, max_tokens=8, logprobs=True, top_logprobs=3)
    assert got.choices[0].message.content == text
    assert_logprobs_equal(got.choices[0].logprobs.content, want)
    streamed: list[Any] = []
    for chunk in litellm_call(base_url, LOGPROB_QUESTION, max_tokens=8, logprobs=True, top_logprobs=3, stream=True):
        logprobs = getattr(chunk.choices[0], "logprobs", None)
        if logprobs and logprobs.content:
            streamed += logprobs.content
    assert_logprobs_equal(streamed, want)


# --------------------------------------------------------------------------- structured output
class City(pydantic.BaseModel):
    """A city and the country it is in."""

    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false, as strict wants
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    is_capital: bool


CITY_QUESTION = "Describe Paris as JSON."
STRUCTURED_TOKENS = 60


def test_langchain_structured_output_json_schema(base_url: str, reference: openai.OpenAI, sent: Recorder) -> None:
    llm = chat_model(base_url, sent, max_tokens=STRUCTURED_TOKENS)
    got = llm.with_structured_output(City, method="json_schema").invoke(CITY_QUESTION)
    assert isinstance(got, City)
    fmt = sent.last["response_format"]
    assert fmt["type"] == "json_schema" and set(fmt["json_schema"]["schema"]["properties"]) == set(City.model_fields)
    # the same response_format through the official client: the same object, and it validates
    want = official_chat(reference, CITY_QUESTION, max_tokens=STRUCTURED_TOKENS, response_format=fmt)
    text = want.choices[0].message.content
    assert want.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), fmt["json_schema"]["schema"])
    assert got == City.model_validate_json(text)
    # with the raw message beside it, and as a dict schema
    raw = llm.with_structured_output(City, method="json_schema", include_raw=True).invoke(CITY_QUESTION)
    assert raw["parsing_error"] is None and raw["parsed"] == got and raw["raw"].content == text
    as_dict = llm.with_structured_output(City.model_json_schema(), method="json_schema").invoke(CITY_QUESTION)
    jsonschema.validate(as_dict, City.model_json_schema())


async def test_langchain_structured_output_json_mode(base_url: str, reference: openai.OpenAI, sent: Recorder) -> None:
    llm = chat_model(base_url, sent, max_tokens=STRUCTURED_TOKENS)
    got = await llm.with_structured_output(None, method="json_mode").ainvoke(CITY_QUESTION)
    assert sent.last["response_format"] == {"type": "json_object"}
    want = official_chat(reference, CITY_QUESTION, max_tokens=STRUCTURED_TOKENS, response_format={"type": "json_object"})
    assert isinstance(got, dict) and got == json.loads(want.choices[0].message.content)


def test_litellm_structured_output_json_schema(base_url: str, reference: openai.OpenAI) -> None:
    schema = City.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    want = official_chat(reference, CITY_QUESTION, max_tokens=STRUCTURED_TOKENS, response_format=fmt)
    got = litellm_call(base_url, CITY_QUESTION, max_tokens=STRUCTURED_TOKENS, response_format=fmt)
    text = got.choices[0].message.content
    assert text == want.choices[0].message.content and got.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    # a pydantic class, as LiteLLM's users pass it
    got = litellm_call(base_url, CITY_QUESTION, max_tokens=STRUCTURED_TOKENS, response_format=City)
    City.model_validate_json(got.choices[0].message.content)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in litellm_call(base_url, CITY_QUESTION, max_tokens=STRUCTURED_TOKENS, response_format=fmt, stream=True)
    )
    assert streamed == text


# --------------------------------------------------------------------------- tools
NAMED = {"type": "function", "function": {"name": "get_weather"}}
TOOL_TOKENS = 100


def check_args(name: str, args: dict[str, Any]) -> None:
    [tool] = [t for t in (WEATHER, TIME) if t["function"]["name"] == name]
    jsonschema.validate(args, tool["function"]["parameters"])  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tool_references(reference: openai.OpenAI) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """The official client's calls (name, arguments) for a named function and for "required"."""
    answers = {}
    for name, choice in (("named", NAMED), ("required", "required")):
        got = official_chat(reference, ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=TOOL_TOKENS)
        assert got.choices[0].finish_reason == "tool_calls"
        calls = got.choices[0].message.tool_calls or []
        answers[name] = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
        assert answers[name]
        for call_name, args in answers[name]:
            check_args(call_name, args)
    assert [n for n, _ in answers["named"]] == ["get_weather"]
    return answers


def test_langchain_tool_calls(base_url: str, tool_references, sent: Recorder) -> None:
    llm = chat_model(base_url, sent, max_tokens=TOOL_TOKENS)
    named = llm.bind_tools([WEATHER, TIME], tool_choice="get_weather")
    answer = named.invoke(ASK)
    assert sent.last["tool_choice"] == NAMED
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == tool_references["named"]
    assert answer.response_metadata["finish_reason"] == "tool_calls" and not answer.invalid_tool_calls
    # streamed: LangChain assembles the deltas into the same call
    chunks = list(named.stream(ASK))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == tool_references["named"]
    # "any" is OpenAI's "required"
    required = llm.bind_tools([WEATHER, TIME], tool_choice="any").invoke(ASK)
    assert sent.last["tool_choice"] == "required"
    assert [(c["name"], c["args"]) for c in required.tool_calls] == tool_references["required"]


def test_langchain_tool_message_round_trip(base_url: str, reference: openai.OpenAI, sent: Recorder) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = chat_model(base_url, sent, max_tokens=24).bind_tools([WEATHER])
    call = chat_model(base_url, max_tokens=TOOL_TOKENS).bind_tools([WEATHER], tool_choice="get_weather").invoke(ASK)
    [tool_call] = call.tool_calls
    answer = llm.invoke([HumanMessage(ASK), call, ToolMessage(TOOL_RESULT, tool_call_id=tool_call["id"])])
    assistant, tool = sent.last["messages"][1:]
    assert assistant["role"] == "assistant" and assistant["content"] is None and tool["role"] == "tool"
    # the same history through the official client: LangChain sends the arguments as json.dumps does
    history = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": tool_call["id"], "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(tool_call["args"])}},
        ]},
        {"role": "tool", "tool_call_id": tool_call["id"], "content": TOOL_RESULT},
    ]  # fmt: skip
    want = official_chat(reference, history, tools=[WEATHER], max_tokens=24)
    assert answer.content == (want.choices[0].message.content or "")
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in want.choices[0].message.tool_calls or []
    ]


def test_litellm_tool_calls_streamed_and_not(base_url: str, tool_references) -> None:
    import litellm

    for name, choice in (("named", NAMED), ("required", "required")):
        got = litellm_call(base_url, ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=TOOL_TOKENS)
        assert got.choices[0].finish_reason == "tool_calls"
        calls = got.choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == tool_references[name]
        # streamed: the deltas by index, as a client assembles them, and LiteLLM's own builder
        chunks = list(litellm_call(base_url, ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=TOOL_TOKENS, stream=True))
        assembled: dict[int, list[str]] = {}
        for chunk in chunks:
            for delta in chunk.choices[0].delta.tool_calls or []:
                entry = assembled.setdefault(delta.index, ["", ""])
                entry[0] += delta.function.name or ""
                entry[1] += delta.function.arguments or ""
        assert [(n, json.loads(a)) for _, (n, a) in sorted(assembled.items())] == tool_references[name]
        built = litellm.stream_chunk_builder(chunks)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in built.choices[0].message.tool_calls] == tool_references[name]


# --------------------------------------------------------------------------- streamed usage
def test_streamed_usage_through_both(base_url: str, reference: openai.OpenAI, sent: Recorder) -> None:
    want = official_chat(reference, QUESTION)
    usage = want.usage
    chunks = list(chat_model(base_url, sent, stream_usage=True).stream(QUESTION))
    assert sent.last["stream_options"] == {"include_usage": True}
    metadata = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert len(metadata) == 1
    assert (metadata[0]["input_tokens"], metadata[0]["output_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert "".join(str(c.content) for c in chunks) == want.choices[0].message.content
    # stream_usage set, then invoke: a plain request; streaming=True: invoke streams and sums the usage
    plain = chat_model(base_url, sent, stream_usage=True).invoke(QUESTION)
    assert "stream_options" not in sent.last and plain.usage_metadata["output_tokens"] == usage.completion_tokens
    summed = chat_model(base_url, sent, streaming=True, stream_usage=True).invoke(QUESTION)
    assert sent.last["stream"] is True and summed.content == want.choices[0].message.content
    assert (summed.usage_metadata["input_tokens"], summed.usage_metadata["output_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    streamed = list(litellm_call(base_url, QUESTION, stream=True, stream_options={"include_usage": True}))
    usages = [c.usage for c in streamed if getattr(c, "usage", None)]
    assert usages and (usages[-1].prompt_tokens, usages[-1].completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)


# --------------------------------------------------------------------------- the completions class
def test_langchain_completions_options(base_url: str, reference: openai.OpenAI, tokenizer, sent: Recorder) -> None:
    options: dict[str, Any] = {"presence_penalty": 1.0, "frequency_penalty": 1.5, "max_tokens": 16}
    prompt = "Monday, Tuesday, Wednesday, Monday, Tuesday,"
    want = reference.completions.create(model=MODEL, prompt=prompt, temperature=0, **options).choices[0].text
    plain = reference.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16).choices[0].text
    assert want != plain
    assert completions_model(base_url, sent, **options).invoke(prompt) == want
    assert sent.last["prompt"] == [prompt] and sent.last["presence_penalty"] == 1.0
    bias = {str(token_id(tokenizer, " banana")): 100}
    seeded = completions_model(base_url, temperature=1.0, seed=3, logit_bias=bias, max_tokens=4).invoke(prompt)
    assert seeded == " banana" * 4
    stopped = reference.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=8, stop=[" the"])
    assert completions_model(base_url).invoke(PROMPTS[0], stop=[" the"]) == stopped.choices[0].text


def test_langchain_completions_list_of_prompts_with_n_and_logprobs(base_url: str, reference: openai.OpenAI, sent: Recorder) -> None:
    want = reference.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, n=2, logprobs=2)
    assert [c.index for c in want.choices] == [0, 1, 2, 3]  # prompt-major, as OpenAI orders them
    result = completions_model(base_url, sent, max_tokens=6, n=2, logprobs=2).generate(PROMPTS)
    assert sent.last["prompt"] == PROMPTS and len(sent.bodies) == 1  # one request
    got = [g for per_prompt in result.generations for g in per_prompt]
    assert [len(p) for p in result.generations] == [2, 2]
    assert [g.text for g in got] == [c.text for c in want.choices]
    for generation, choice in zip(got, want.choices):
        logprobs = generation.generation_info["logprobs"]
        assert logprobs["tokens"] == choice.logprobs.tokens
        assert logprobs["token_logprobs"] == pytest.approx(choice.logprobs.token_logprobs, abs=LOGPROB_ATOL)
        assert [sorted(t) for t in logprobs["top_logprobs"]] == [sorted(t) for t in choice.logprobs.top_logprobs]
    assert result.llm_output["token_usage"]["completion_tokens"] == want.usage.completion_tokens


async def test_langchain_completions_async_batch(base_url: str, reference: openai.OpenAI) -> None:
    want = [reference.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in PROMPTS]
    assert await completions_model(base_url).abatch(PROMPTS) == want
    assert "".join([part async for part in completions_model(base_url).astream(PROMPTS[1])]) == want[1]


# --------------------------------------------------------------------------- the Responses API
def test_langchain_responses_api(base_url: str, reference: openai.OpenAI, sent: Recorder) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage

    want = official_chat(reference, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}], max_tokens=12)
    text = want.choices[0].message.content
    llm = chat_model(base_url, sent, max_tokens=12, use_responses_api=True)
    messages = [SystemMessage("Answer briefly."), HumanMessage(QUESTION)]
    answer = llm.invoke(messages)
    assert sent.last["max_output_tokens"] == 12 and "input" in sent.last  # it went to /v1/responses
    assert answer.text == text
    assert answer.usage_metadata is not None
    assert (answer.usage_metadata["input_tokens"], answer.usage_metadata["output_tokens"]) == (
        want.usage.prompt_tokens, want.usage.completion_tokens,
    )  # fmt: skip
    chunks = list(llm.stream(messages))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert whole.text == text


def test_langchain_responses_api_structured_output(base_url: str, reference: openai.OpenAI, sent: Recorder) -> None:
    llm = chat_model(base_url, sent, max_tokens=STRUCTURED_TOKENS, use_responses_api=True)
    got = llm.with_structured_output(City, method="json_schema").invoke(CITY_QUESTION)
    assert isinstance(got, City)
    fmt = sent.last["text"]["format"]
    assert fmt["type"] == "json_schema"
    chat_format = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    want = official_chat(reference, CITY_QUESTION, max_tokens=STRUCTURED_TOKENS, response_format=chat_format)
    assert got == City.model_validate_json(want.choices[0].message.content)


# --------------------------------------------------------------------------- more of what users set
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """Get the current weather in a city.

    Args:
        city: The city.
        unit: The unit of temperature.
    """
    raise AssertionError("the model calls it; the test does not")


def test_langchain_function_calling_structured_output_and_strict_tools(base_url: str, reference: openai.OpenAI, sent: Recorder) -> None:
    llm = chat_model(base_url, sent, max_tokens=STRUCTURED_TOKENS)
    got = llm.with_structured_output(City, method="function_calling", strict=True).invoke(CITY_QUESTION)
    assert isinstance(got, City)
    body = sent.last
    [tool] = body["tools"]
    assert tool["function"]["strict"] is True and body["parallel_tool_calls"] is False
    assert body["tool_choice"] == {"type": "function", "function": {"name": "City"}}
    want = official_chat(
        reference, CITY_QUESTION, max_tokens=STRUCTURED_TOKENS, tools=body["tools"], tool_choice=body["tool_choice"], parallel_tool_calls=False
    )
    [call] = want.choices[0].message.tool_calls or []
    assert got == City.model_validate_json(call.function.arguments)
    # a Python function bound with strict and parallel_tool_calls, tool_choice "auto"
    auto = llm.bind_tools([get_weather, TIME], tool_choice="auto", strict=True, parallel_tool_calls=False).invoke(ASK)
    body = sent.last
    assert body["tool_choice"] == "auto" and body["tools"][0]["function"]["strict"] is True
    assert body["tools"][0]["function"]["parameters"]["required"] == ["city", "unit"]
    want = official_chat(reference, ASK, max_tokens=STRUCTURED_TOKENS, tools=body["tools"], tool_choice="auto", parallel_tool_calls=False)
    assert auto.content == (want.choices[0].message.content or "")
    assert [(c["name"], c["args"]) for c in auto.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in want.choices[0].message.tool_calls or []
    ]


def test_langchain_text_parts_and_vllm_extensions(base_url: str, reference: openai.OpenAI, sent: Recorder) -> None:
    from langchain_core.messages import HumanMessage

    extras = {"repetition_penalty": 1.3, "min_p": 0.05, "top_k": 20}
    want = official_chat(reference, DAYS, max_tokens=24, extra_body=extras).choices[0].message.content
    assert want != official_chat(reference, DAYS, max_tokens=24).choices[0].message.content
    llm = chat_model(base_url, sent, max_tokens=24, extra_body=extras)
    parts = [{"type": "text", "text": "List the days of the week,"}, {"type": "text", "text": "then list them again."}]
    joined = official_chat(reference, [{"role": "user", "content": parts}], max_tokens=24, extra_body=extras).choices[0].message.content
    assert llm.invoke([HumanMessage(content=parts)]).content == joined  # type: ignore[arg-type]
    assert sent.last["messages"][0]["content"] == parts
    assert llm.invoke(DAYS).content == want
    assert all(sent.last[k] == v for k, v in extras.items())


def test_litellm_vllm_extensions_json_object_and_a_tool_round_trip(base_url: str, reference: openai.OpenAI) -> None:
    extras = {"repetition_penalty": 1.3, "min_p": 0.05, "top_k": 20}
    want = official_chat(reference, DAYS, max_tokens=24, extra_body=extras).choices[0].message.content
    assert litellm_call(base_url, DAYS, max_tokens=24, extra_body=extras).choices[0].message.content == want
    fmt = {"type": "json_object"}
    want = official_chat(reference, CITY_QUESTION, max_tokens=STRUCTURED_TOKENS, response_format=fmt).choices[0].message.content
    got = litellm_call(base_url, CITY_QUESTION, max_tokens=STRUCTURED_TOKENS, response_format=fmt).choices[0].message.content
    assert got == want and isinstance(json.loads(got), dict)
    call = litellm_call(base_url, ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=TOOL_TOKENS).choices[0].message
    [tool_call] = call.tool_calls
    history = [
        {"role": "user", "content": ASK},
        call.model_dump(exclude_none=False),  # the assistant message as LiteLLM returned it
        {"role": "tool", "tool_call_id": tool_call.id, "content": TOOL_RESULT},
    ]
    got = litellm_call(base_url, history, tools=[WEATHER], max_tokens=24).choices[0].message
    plain_history = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": tool_call.id, "type": "function", "function": {"name": "get_weather", "arguments": tool_call.function.arguments}},
        ]},
        {"role": "tool", "tool_call_id": tool_call.id, "content": TOOL_RESULT},
    ]  # fmt: skip
    want = official_chat(reference, plain_history, tools=[WEATHER], max_tokens=24).choices[0].message
    assert got.content == want.content


def test_litellm_streamed_n_and_parallel_tool_calls(base_url: str, four_choices: list[str], tool_references) -> None:
    texts = ["", "", "", ""]
    for chunk in litellm_call(base_url, SEA, n=4, stream=True, **N_OPTIONS):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == four_choices
    got = litellm_call(base_url, ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=TOOL_TOKENS)
    calls = got.choices[0].message.tool_calls
    assert len(calls) == 1 and (calls[0].function.name, json.loads(calls[0].function.arguments)) == tool_references["required"][0]


def test_litellm_text_completion(base_url: str, reference: openai.OpenAI) -> None:
    import litellm

    want = reference.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, logprobs=2, echo=True)
    got = litellm.text_completion(
        model=f"text-completion-openai/{MODEL}", api_base=base_url, api_key="unused", prompt=PROMPTS,
        max_tokens=6, temperature=0, logprobs=2, echo=True, num_retries=0, timeout=60,
    )  # fmt: skip
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    assert got.choices[0].text.startswith(PROMPTS[0])
    for choice, ref in zip(got.choices, want.choices):
        assert choice.logprobs.tokens == ref.logprobs.tokens
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(ref.logprobs.token_logprobs[1:], abs=LOGPROB_ATOL)


def test_langchain_responses_api_conversation_and_what_it_refuses(base_url: str, reference: openai.OpenAI, sent: Recorder) -> None:
    """An answer sent back as history (its message item, with id, status and output_text parts),
    streamed usage, and what kvmesh's Responses API does not do refused by name."""
    from langchain_core.messages import HumanMessage

    llm = chat_model(base_url, sent, max_tokens=12, use_responses_api=True)
    first = llm.invoke(QUESTION)
    follow_up = "And of Italy?"
    answer = llm.invoke([HumanMessage(QUESTION), first, HumanMessage(follow_up)])
    item = sent.last["input"][1]
    assert item["role"] == "assistant" and item["content"][0]["type"] == "output_text"
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": follow_up},
    ]
    want = official_chat(reference, history, max_tokens=12)
    assert answer.text == want.choices[0].message.content
    chunks = list(chat_model(base_url, sent, max_tokens=12, use_responses_api=True, stream_usage=True).stream(QUESTION))
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert [(u["input_tokens"], u["output_tokens"]) for u in usage] == [(first.usage_metadata["input_tokens"], first.usage_metadata["output_tokens"])]
    for refused, param in (
        (chat_model(base_url, use_responses_api=True, top_logprobs=2), "top_logprobs"),
        (chat_model(base_url, use_responses_api=True).bind_tools([WEATHER]), "tools"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            refused.invoke(QUESTION)
        assert info.value.body["param"] == param, info.value.body


def test_langchain_structured_output_streamed(base_url: str, reference: openai.OpenAI, sent: Recorder) -> None:
    llm = chat_model(base_url, sent, max_tokens=STRUCTURED_TOKENS).with_structured_output(City, method="json_schema")
    parsed = list(llm.stream(CITY_QUESTION))
    fmt = sent.last["response_format"]
    assert sent.last["stream"] is True
    want = official_chat(reference, CITY_QUESTION, max_tokens=STRUCTURED_TOKENS, response_format=fmt)
    assert parsed[-1] == City.model_validate_json(want.choices[0].message.content)


class Landmark(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    kind: Literal["museum", "tower", "church", "park"]


class Guide(pydantic.BaseModel):
    """A short guide to a city: nested models, an optional field and a bounded list ($defs, anyOf null)."""

    city: City
    landmarks: list[Landmark] = pydantic.Field(min_length=1, max_length=2)
    motto: str | None = pydantic.Field(default=None, max_length=30)


def test_structured_output_with_nested_and_optional_fields(base_url: str, reference: openai.OpenAI, sent: Recorder) -> None:
    question = "Write a short guide to Paris as JSON."
    llm = chat_model(base_url, sent, max_tokens=120)
    got = llm.with_structured_output(Guide, method="json_schema", strict=True).invoke(question)
    assert isinstance(got, Guide)
    fmt = sent.last["response_format"]
    assert "$defs" in fmt["json_schema"]["schema"]
    want = official_chat(reference, question, max_tokens=120, response_format=fmt)
    assert got == Guide.model_validate_json(want.choices[0].message.content)
    # the official client's own strict conversion of the same class
    parsed = reference.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=120, temperature=0, response_format=Guide)
    assert isinstance(parsed.choices[0].message.parsed, Guide)


def test_a_named_message_is_answered_as_the_official_clients(base_url: str, reference: openai.OpenAI, sent: Recorder) -> None:
    """LangChain sends a message's ``name`` (a LangGraph agent's answers carry one); the router
    takes it as OpenAI and vLLM do (it used to refuse it with a 400)."""
    from langchain_core.messages import HumanMessage

    want = reference.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION, "name": "alice"}], max_tokens=16, temperature=0
    )
    got = chat_model(base_url, sent).invoke([HumanMessage(QUESTION, name="alice")])
    assert sent.last["messages"] == [{"role": "user", "content": QUESTION, "name": "alice"}]
    assert got.content == want.choices[0].message.content and got.content


def test_litellm_streamed_text_completion_and_extensions_as_keywords(base_url: str, reference: openai.OpenAI) -> None:
    import litellm

    want = reference.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, n=2)
    texts = ["", "", "", ""]
    for chunk in litellm.text_completion(
        model=f"text-completion-openai/{MODEL}", api_base=base_url, api_key="unused", prompt=PROMPTS, n=2,
        max_tokens=6, temperature=0, stream=True, num_retries=0, timeout=60,
    ):  # fmt: skip
        for choice in chunk.choices:
            texts[choice.index] += choice.text or ""
    assert texts == [c.text for c in want.choices]
    extras = {"repetition_penalty": 1.3, "top_k": 20}
    want_text = official_chat(reference, DAYS, max_tokens=24, extra_body=extras).choices[0].message.content
    assert litellm_call(base_url, DAYS, max_tokens=24, **extras).choices[0].message.content == want_text


async def test_litellm_async_streamed_tool_calls_and_usage(base_url: str, tool_references) -> None:
    import litellm

    stream = await litellm.acompletion(
        model=f"openai/{MODEL}", api_base=base_url, api_key="unused", messages=[{"role": "user", "content": ASK}],
        tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=TOOL_TOKENS, stream=True,
        stream_options={"include_usage": True}, num_retries=0, timeout=60,
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    built = litellm.stream_chunk_builder(chunks)
    calls = built.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == tool_references["required"]
    assert built.usage.completion_tokens > 0


async def test_pools_back_at_baseline(mesh: LocalMesh) -> None:
    await assert_pools_at_baseline(mesh, ["prefill-1", "decode-2"])
