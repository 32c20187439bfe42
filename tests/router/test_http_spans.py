"""Each HTTP request to the router is one OpenTelemetry server span, the root of what the mesh
does for it (``http_spans``): named by its route, continuing a client's trace, current while
the request is served, ended after a stream's last chunk, failed on a 5xx; probes untraced."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.protocol import SamplingSpec, TokenEvent
from kvmesh.services.router.app import create_app
from kvmesh.services.router.limits import Limits
from tests.router.fakes import Emit, FakeBackend, Finish
from tests.router.served import served

MODEL = "tiny-llama"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


class SpanSeeingBackend(FakeBackend):
    """Records the span current when the router hands it a request."""

    seen: list[trace.Span]

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *, session_id: str | None = None
    ) -> AsyncIterator[TokenEvent]:
        self.seen.append(trace.get_current_span())
        return super().generate(request_id, prompt_token_ids, sampling, session_id=session_id)


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    yield spans
    spans.shutdown()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def finished(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return list(exporter.get_finished_spans())


async def test_a_streamed_completion_is_one_server_span_around_the_whole_stream(
    tokenizer: Tokenizer, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    backend = SpanSeeingBackend(tokenizer, script=[Emit((5,), "Hi"), Emit((6,), " there"), Finish("length")])
    backend.seen = []
    app = create_app(backend, tracer_provider=provider)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": True}
    traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
    async with served(app, Limits()) as router:
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
            async with client.stream("POST", "/v1/completions", json=body, headers={"traceparent": traceparent}) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines()]
    assert "data: [DONE]" in lines
    (span,) = finished(exporter)
    assert span.name == "POST /v1/completions"
    assert span.kind is SpanKind.SERVER
    http = {
        "http.request.method": "POST",
        "url.path": "/v1/completions",
        "url.scheme": "http",
        "network.protocol.version": "1.1",
        "http.route": "/v1/completions",
        "http.response.status_code": 200,
    }
    assert {key: value for key, value in (span.attributes or {}).items() if key in http} == http
    # and what the router's request accounting puts on the request's span
    assert span.attributes is not None and span.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert span.status.status_code is StatusCode.UNSET
    # the client's trace goes on: the router's span is its child
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == CLIENT_SPAN_ID
    # what the router does for the request (the mesh's spans) is under it
    (current,) = backend.seen
    assert current.get_span_context().span_id == span.context.span_id
    assert backend.finished  # the stream ran to its end before the span ended


async def test_without_a_traceparent_the_span_starts_a_trace_and_routes_name_it(
    tokenizer: Tokenizer, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    app = create_app(FakeBackend(tokenizer), tracer_provider=provider)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await client.get(f"/v1/models/{MODEL}")).status_code == 200
        assert (await client.get("/v1/nowhere")).status_code == 404
    model, nowhere = finished(exporter)
    assert model.parent is None
    assert model.name == "GET /v1/models/{model:path}"
    assert model.attributes is not None and model.attributes["url.path"] == f"/v1/models/{MODEL}"
    # no route matched: the method alone, as OpenTelemetry's HTTP conventions name it
    assert nowhere.name == "GET"
    assert nowhere.attributes is not None and "http.route" not in nowhere.attributes
    assert nowhere.attributes["http.response.status_code"] == 404
    assert nowhere.status.status_code is StatusCode.UNSET  # a client's mistake is not the server's failure


async def test_probes_and_scrapes_make_no_spans(
    tokenizer: Tokenizer, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    app = create_app(FakeBackend(tokenizer), tracer_provider=provider)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        for path in ("/health", "/health/live", "/health/ready", "/metrics"):
            assert (await client.get(path)).status_code == 200, path
    assert finished(exporter) == []


class BrokenTokenizer(Tokenizer):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if "break" in text:
            raise TypeError("TextInputSequence must be str")
        return super().encode(text, add_special_tokens=add_special_tokens)


async def test_an_answer_of_500_marks_the_span_failed_and_a_400_does_not(
    fake: FakeBackend, tokenizer: Tokenizer, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    fake.tokenizer = BrokenTokenizer(tokenizer.backend, chat_template=tokenizer.chat_template)
    app = create_app(fake, tracer_provider=provider)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": "please break"})).status_code == 500
        assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})).status_code == 400
    broken, refused = finished(exporter)
    assert broken.attributes is not None and broken.attributes["http.response.status_code"] == 500
    assert broken.status.status_code is StatusCode.ERROR
    assert refused.attributes is not None and refused.attributes["http.response.status_code"] == 400
    assert refused.status.status_code is StatusCode.UNSET
