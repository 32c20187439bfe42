"""One error vocabulary: every code has an HTTP status and a retry rule, and the wire
format carries codes, not free strings."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvmesh.errors import ERROR_KINDS, ErrorCode, MeshError, as_error_code, http_status, is_retryable
from kvmesh.protocol import ErrorInfo


def test_every_code_has_a_kind():
    assert set(ERROR_KINDS) == set(ErrorCode)


@pytest.mark.parametrize(
    ("code", "status", "retry"),
    [
        ("bad_request", 400, False),
        ("too_large", 413, False),
        ("overloaded", 503, True),
        ("unavailable", 503, True),
        ("kv_lost", 503, True),
        ("timeout", 504, False),
        ("internal", 500, True),
        ("request_failed", 500, False),
        ("cancelled", 499, False),
    ],
)
def test_status_and_retry(code, status, retry):
    assert (http_status(code), is_retryable(code)) == (status, retry)
    error = MeshError(code, "m")
    assert (error.code, error.http_status, error.retryable) == (ErrorCode(code), status, retry)


def test_an_unknown_code_is_internal():
    assert as_error_code("nonsense") is ErrorCode.INTERNAL
    assert MeshError("nonsense", "m").code is ErrorCode.INTERNAL


def test_error_info_takes_codes_only():
    info = ErrorInfo.decode(b'{"code": "kv_lost", "message": "gone"}')
    assert info.code is ErrorCode.KV_LOST
    assert ErrorInfo.decode(info.encode()) == info
    assert ErrorInfo.decode(b'{"code": "whatever", "message": "x"}').code is ErrorCode.INTERNAL  # a newer peer's
    with pytest.raises(ValidationError):
        ErrorInfo.decode(b'{"code": "internal"}')  # no message
