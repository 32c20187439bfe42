"""LangChain (``langchain-openai``: the chat class and the completions class) and LiteLLM's
openai-compatible provider against a running mesh: invoke and stream give the official client's
greedy text. Neither may reach anything but loopback: the cost map is LiteLLM's local copy,
tracing is off, and a socket guard fails the test on any connect (or name lookup) elsewhere."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from kvmesh.infra.local_mesh import LocalMesh
from tests.mesh.meshes import MODEL

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
