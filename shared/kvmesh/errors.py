"""The domain's exceptions and the one error vocabulary of the mesh.

Every error that crosses a process carries an ``ErrorCode``; what HTTP status it becomes at
the router's edge and whether the router may retry it on other workers is said once, in
``ERROR_KINDS``. Services translate their exceptions into these codes at their edges.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ErrorCode(str, enum.Enum):
    BAD_REQUEST = "bad_request"  # the request itself is wrong: the same on every worker
    TOO_LARGE = "too_large"  # a message the mesh cannot carry (larger than NATS's max_payload)
    OVERLOADED = "overloaded"  # this worker has no room now; another may
    UNAVAILABLE = "unavailable"  # no worker can take it now, or this one is going away
    KV_LOST = "kv_lost"  # the prefill's KV could not be pulled (its worker or pin is gone)
    TIMEOUT = "timeout"  # the request's own deadline passed
    INTERNAL = "internal"  # something unexpected broke on a worker; another may succeed
    REQUEST_FAILED = "request_failed"  # the engine failed this request (the same input fails anywhere)
    CANCELLED = "cancelled"  # the client went away


@dataclass(slots=True, frozen=True)
class ErrorKind:
    http_status: int
    retryable: bool  # the router may try the request again on other workers


ERROR_KINDS: dict[ErrorCode, ErrorKind] = {
    ErrorCode.BAD_REQUEST: ErrorKind(400, False),
    ErrorCode.TOO_LARGE: ErrorKind(413, False),
    ErrorCode.OVERLOADED: ErrorKind(503, True),
    ErrorCode.UNAVAILABLE: ErrorKind(503, True),
    ErrorCode.KV_LOST: ErrorKind(503, True),
    ErrorCode.TIMEOUT: ErrorKind(504, False),
    ErrorCode.INTERNAL: ErrorKind(500, True),
    ErrorCode.REQUEST_FAILED: ErrorKind(500, False),
    ErrorCode.CANCELLED: ErrorKind(499, False),  # nginx's "client closed request"
}


def as_error_code(code: str | ErrorCode) -> ErrorCode:
    """The code for a string off the wire; an unknown one is ``internal``."""
    try:
        return ErrorCode(code)
    except ValueError:
        return ErrorCode.INTERNAL


def http_status(code: str | ErrorCode) -> int:
    return ERROR_KINDS[as_error_code(code)].http_status


def is_retryable(code: str | ErrorCode) -> bool:
    return ERROR_KINDS[as_error_code(code)].retryable


class KvmeshError(Exception):
    """Base of every error kvmesh raises on purpose."""


class ModelLoadError(KvmeshError, ValueError):
    """The model, its weights, its tokenizer or the device could not be loaded or used."""


class EngineConfigError(KvmeshError, ValueError):
    """The engine's settings make no engine: a KV pool too small for one block, a batch of none."""


class ListenError(KvmeshError):
    """A service cannot listen where its settings say: no such address, a port in use."""

    def __init__(self, host: str, port: int, exc: OSError) -> None:
        super().__init__(f"cannot listen on {host} port {port}: {exc.strerror or exc}")


class EngineError(KvmeshError, RuntimeError):
    """The engine cannot serve requests."""


class EngineDeadError(EngineError):
    """The engine stopped (shut down or failed); no request can proceed."""


class MeshError(KvmeshError):
    """A request failed in the mesh, with one of the ``ErrorCode``s."""

    def __init__(self, code: str | ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = as_error_code(code)
        self.message = message

    @property
    def http_status(self) -> int:
        return ERROR_KINDS[self.code].http_status

    @property
    def retryable(self) -> bool:
        return ERROR_KINDS[self.code].retryable
