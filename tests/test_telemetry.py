"""The services' logging: trace ids on every record, settings logged with secrets masked."""

from __future__ import annotations

import logging

from opentelemetry.sdk.trace import TracerProvider

from kvmesh.telemetry import LOG_FORMAT, MASK, OneLineFilter, TraceContextFilter, log_settings, masked


def test_secrets_are_masked_and_paths_are_not():
    assert masked("api_key", "sk-123") == MASK
    assert masked("nats_password", "hunter2") == MASK
    assert masked("api_key_file", "/run/keys") == "/run/keys"
    assert masked("nats_credentials", "/run/creds") == "/run/creds"
    assert masked("nats_url", "nats://router:s3cret@nats:4222") == f"nats://router:{MASK}@nats:4222"
    assert masked("etcd_endpoints", ("http://root:pw@etcd:2379", "http://etcd2:2379")) == (
        f"http://root:{MASK}@etcd:2379", "http://etcd2:2379",
    )  # fmt: skip
    assert masked("nats_url", "nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    # an etcd endpoint with its user and password and no scheme, as EtcdStore takes it
    assert masked("etcd_endpoints", ("root:pw@etcd:2379", "etcd2:2379")) == (f"root:{MASK}@etcd:2379", "etcd2:2379")
    assert masked("served_model_name", "team@models") == "team@models"  # no password in it
    assert masked("api_key", None) is None
    assert masked("max_num_batched_tokens", 1024) == 1024  # tokens, not a token
    assert masked("pin_token", "abc") == MASK


def test_log_lines_name_their_trace(caplog):
    formatter = logging.Formatter(LOG_FORMAT)
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(formatter.format(record))

    keep = Keep()
    keep.addFilter(TraceContextFilter())
    log = logging.getLogger("kvmesh.test_telemetry")
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:
        log.info("outside")
        tracer = TracerProvider().get_tracer("t")
        with tracer.start_as_current_span("s") as span:
            log.info("inside")
            context = span.get_span_context()
    finally:
        log.removeHandler(keep)
    assert "[trace=- span=-]: outside" in records[0]
    assert f"[trace={context.trace_id:032x} span={context.span_id:016x}]: inside" in records[1]
    with caplog.at_level(logging.INFO, logger="kvmesh.telemetry"):
        log_settings("svc", {"nats_url": "nats://a:b@h:1", "api_key": "k"})
    assert caplog.messages[-1] == "svc settings: nats_url=nats://a:***@h:1, api_key=***"


def test_a_message_stays_on_one_line():
    """Control characters, line separators and lone surrogates in a message (from its
    arguments, which may quote a client) become escapes; tabs and other text stay."""
    record = logging.LogRecord("n", logging.INFO, "p", 1, "%s rejected: %s", ("/a\x00b", "y\nFORGED\u2028\ud800 é\t中"), None)
    assert OneLineFilter().filter(record)
    assert record.getMessage() == "/a\\x00b rejected: y\\nFORGED\\u2028\\ud800 é\t中"
    plain = logging.LogRecord("n", logging.INFO, "p", 1, "%d blocks", (3,), None)
    assert OneLineFilter().filter(plain) and (plain.msg, plain.args) == ("%d blocks", (3,))  # untouched
