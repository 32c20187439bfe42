"""OpenTelemetry for every service: one tracer provider per process, W3C trace context in
NATS headers, OTLP/HTTP export when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set; and the
services' log format (``setup_logging``), whose every line names the trace and span it
was logged in (``trace=- span=-`` outside any)."""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

logger = logging.getLogger(__name__)

_provider: TracerProvider | None = None

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [trace=%(trace_id)s span=%(span_id)s]: %(message)s"


class TraceContextFilter(logging.Filter):
    """Puts the current span's trace and span ids on every record (``-`` without one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        context_ = trace.get_current_span().get_span_context()
        if context_.is_valid:
            record.trace_id = format(context_.trace_id, "032x")
            record.span_id = format(context_.span_id, "016x")
        else:
            record.trace_id = record.span_id = "-"
        return True


# What may not reach a log line as it is: line breaks (a forged line), NUL and the other
# control characters (a terminal's escapes; grep calling the file binary), lone surrogates
# (not encodable: the line would be lost to a logging error).
_UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def _escaped(match: re.Match[str]) -> str:
    return match.group().encode("unicode_escape", "backslashreplace").decode("ascii")


class OneLineFilter(logging.Filter):
    """A record's message on one line: control characters, line separators and lone surrogates
    written as escapes (``\\n``, ``\\x00``, ``\\ud800``), since a message may quote what a client
    sent (a model name, a path). A traceback is formatted after this and keeps its lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if _UNSAFE.search(message):
            record.msg, record.args = _UNSAFE.sub(_escaped, message), None
        return True


SECRET_WORDS = {"password", "passwd", "secret", "token", "apikey", "key"}  # words of a setting's name
MASK = "***"


def masked(name: str, value: object) -> object:
    """A setting as it may be logged: a value whose name says it is a secret is masked, and
    so is the password of a URL (``nats://user:pass@host``)."""
    if value is None or value == "":
        return value
    words = name.lower().replace("-", "_").split("_")
    if SECRET_WORDS.intersection(words) and words[-1] not in ("file", "credentials", "path"):
        return MASK
    if isinstance(value, str) and "://" in value and "@" in value:
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(value)
        if parts.password is not None:
            netloc = f"{parts.username}:{MASK}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
            return urlunsplit(parts._replace(netloc=netloc))
    if isinstance(value, str) and "://" not in value and "@" in value:  # user:pass@host:port (an etcd endpoint)
        userinfo, _, address = value.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        if colon and "/" not in userinfo:
            return f"{user}:{MASK}@{address}"
    if isinstance(value, (list, tuple)):
        return type(value)(masked(name, v) for v in value)
    return value


def log_settings(service: str, values: dict[str, object]) -> None:
    """The resolved settings, once at start, secrets masked."""
    logger.info("%s settings: %s", service, ", ".join(f"{k}={masked(k, v)}" for k, v in values.items()))


def setup_logging(level: int = logging.INFO) -> None:
    """The services' logging: to stderr, each line with its trace and span ids."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        for kind in (TraceContextFilter, OneLineFilter):
            if not any(isinstance(f, kind) for f in handler.filters):
                handler.addFilter(kind())


def setup_tracing(service_name: str, worker_id: str | None = None) -> TracerProvider:
    """Install the process's tracer provider (once); spans go to OTLP if an endpoint is set."""
    global _provider
    if _provider is not None:
        return _provider
    attributes = {"service.name": service_name}
    if worker_id:
        attributes["service.instance.id"] = worker_id
    provider = TracerProvider(resource=Resource.create(attributes))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        logger.info("tracing: OTLP export for %s", service_name)
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers(ctx: context.Context | None = None) -> dict[str, str]:
    """NATS headers carrying a trace context (``traceparent``): ``ctx``'s, else the current."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def extract_context(headers: dict[str, str] | None) -> context.Context:
    return propagate.extract(headers or {})


def record_queue_wait(tracer_: trace.Tracer, parent: trace.Span, seconds: float) -> None:
    """A ``queue_wait`` child span: the engine's wait before it first scheduled the request,
    taken to start when ``parent`` did."""
    start_ns = getattr(parent, "start_time", None) or time.time_ns()
    record_span(tracer_, parent, "queue_wait", start_ns, start_ns + int(seconds * 1e9), {"kvmesh.queue_seconds": seconds})


def record_span(
    tracer_: trace.Tracer, parent: trace.Span, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any]
) -> None:
    """A child span of ``parent`` from ``start_ns`` to ``end_ns`` (``time.time_ns()``), made
    after the fact: a span started on the first token's path cost it about 0.1 ms after an
    engine step (AVX2-only Zen 3), more than the work it timed."""
    span = tracer_.start_span(name, context=trace.set_span_in_context(parent), start_time=start_ns, attributes=attributes)
    span.end(end_time=end_ns)
