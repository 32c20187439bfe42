"""Traces through a live mesh, as an OTLP collector receives them: each request is one trace
with one root (the router's HTTP span, carrying OpenTelemetry's ``gen_ai.*`` attributes),
joined by the prefill worker's, the decode worker's and kv-metadata's spans, and as many
spans for a 200-token stream as for a 10-token one (no span per SSE chunk). kv-metadata's
ingestion shows as summary spans, and every log line names its trace."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from kvmesh.testing.otlp_sink import OTLPSink, ReceivedSpan
from tests.mesh.client import stream
from tests.mesh.meshes import MODEL, make_mesh

pytestmark = pytest.mark.slow

SERVICES = {"kvmesh-router", "kvmesh-prefill-worker", "kvmesh-decode-worker", "kvmesh-kv-metadata"}
PROMPT = "Here is a list of three fruits: apples, pears and plums. Here are three more fruits:"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, default_model_dir, sink):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100", "KVMESH_INGEST_SPAN_INTERVAL": "0.5",
        "KVMESH_KV_INDEX": "kv-metadata",  # the router asks kv-metadata (its kv_query span joins the trace), not its own copy
    }  # fmt: skip
    local = make_mesh(tmp_path_factory.mktemp("mesh"), default_model_dir, prefill=1, decode=1, env=env)
    yield local
    local.stop()


async def traced_stream(mesh, sink: OTLPSink, max_tokens: int) -> tuple[list[dict], list[ReceivedSpan]]:
    """A streamed completion and every span of its trace, once its root has arrived and
    every service has reported."""
    body = {
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "top_p": 0.9, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    events = await stream(mesh.base_url, "/v1/completions", body)
    response_id = events[0]["id"]
    deadline = time.monotonic() + 15
    while True:
        spans = sink.snapshot()
        roots = [s for s in spans if s.attributes.get("gen_ai.response.id") == response_id]
        if roots:
            trace = [s for s in spans if s.trace_id == roots[0].trace_id]
            if {s.service for s in trace} >= SERVICES or time.monotonic() > deadline:
                await asyncio.sleep(0.5)  # stragglers of the same batch
                return events, [s for s in sink.snapshot() if s.trace_id == roots[0].trace_id]
        elif time.monotonic() > deadline:
            raise AssertionError(f"no root span for {response_id}: {sorted({s.name for s in spans})}")
        await asyncio.sleep(0.1)


def shape(trace: list[ReceivedSpan]) -> list[tuple[str, str]]:
    return sorted((s.service, s.name) for s in trace)


async def test_one_root_per_request_and_as_many_spans_whatever_its_length(mesh, sink):
    short_events, short = await traced_stream(mesh, sink, 10)
    long_events, long = await traced_stream(mesh, sink, 200)
    assert (short_events[-1]["usage"]["completion_tokens"], long_events[-1]["usage"]["completion_tokens"]) == (10, 200)
    for trace in (short, long):
        assert {s.service for s in trace} == SERVICES, shape(trace)
        roots = [s for s in trace if not s.parent_span_id]
        assert len(roots) == 1, shape(trace)
        ids = {s.span_id for s in trace}
        assert all(s.parent_span_id in ids for s in trace if s.parent_span_id), "a span's parent is missing"
        assert not [s.name for s in trace if s.name.endswith(("http send", "http receive"))]
        assert len(trace) <= 12, shape(trace)
        assert ("kvmesh-kv-metadata", "kv_query") in shape(trace)
    assert shape(short) == shape(long)  # the same spans for 10 tokens as for 200


async def test_the_request_span_follows_the_gen_ai_conventions(mesh, sink):
    events, trace = await traced_stream(mesh, sink, 12)
    [root] = [s for s in trace if not s.parent_span_id]
    a = root.attributes
    usage = events[-1]["usage"]
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == MODEL and a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.request.temperature"] == 0 and a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > 0
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 12
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.response.id"] == events[0]["id"]
    assert 0 < a["gen_ai.response.time_to_first_token"] < 30


async def test_ingestion_is_summed_up_not_traced_per_batch(mesh, sink):
    deadline = time.monotonic() + 10
    while not (ingest := [s for s in sink.snapshot() if s.name == "kv_ingest"]) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert ingest, "kv-metadata sent no kv_ingest span"
    assert all(s.service == "kvmesh-kv-metadata" and not s.parent_span_id for s in ingest)
    assert sum(s.attributes["kvmesh.batches"] for s in ingest) >= len(ingest)
    assert sum(s.attributes["kvmesh.blocks_stored"] for s in ingest) > 0


async def test_every_log_line_names_its_trace(mesh, sink):
    events, trace = await traced_stream(mesh, sink, 4)
    trace_id = trace[0].trace_id
    request_id = events[0]["id"].removeprefix("cmpl-")
    line_start = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ \S+ \[trace=([0-9a-f]{32}|-) span=([0-9a-f]{16}|-)\]: ")
    logs = sorted((mesh.workdir / "logs").glob("*.log"))
    services = {"router", "prefill-1", "decode-2", "kv-metadata"}
    assert services <= {p.stem.split(".")[0] for p in logs}, logs
    for path in logs:
        if path.stem not in services:
            continue
        for line in path.read_text().splitlines():
            if re.match(r"^\d{4}-\d\d-\d\d ", line):  # a log record's first line (not a traceback's)
                assert line_start.match(line), (path.name, line)
    router_log = (mesh.workdir / "logs" / "router.log").read_text()
    [line] = [line for line in router_log.splitlines() if f"request {request_id} " in line]
    assert f"[trace={trace_id} " in line
