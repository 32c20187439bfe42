"""What a flag's or a ``KVMESH_*`` variable's text must be: each function turns the text into
its value or raises ``ValueTextError``, which argparse says as is after the flag's name
(``argument --port: must be ...``) and the registry's reader after the variable's
(``KVMESH_ROUTER_PORT='x': must be ...``). Every service and the ``kvmesh`` command use these,
so one kind of value is refused in one wording everywhere."""

from __future__ import annotations

import argparse
import ipaddress
import math
import re
from collections.abc import Callable
from typing import TypeVar


N = TypeVar("N", int, float)
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")  # RFC 1123, and the underscore of compose's names


class ValueTextError(ValueError, argparse.ArgumentTypeError):
    """A text that is not the value it should be; the message says what it must be."""


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueTextError(f"must be an integer, got {text!r}") from None


def number(text: str) -> float:
    """A finite number (no nan, no inf)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueTextError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueTextError(f"must be a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _checked(integer(text), text, lambda value: value >= 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _checked(integer(text), text, lambda value: value >= 0, "0 or more")


def port_number(text: str) -> int:
    """A TCP port to listen on: 0 (a free one) to 65535."""
    return _checked(integer(text), text, lambda value: 0 <= value <= 65535, "a port number in 0..65535")


def positive_number(text: str) -> float:
    """More than 0 and finite: seconds to wait, a rate."""
    return _checked(number(text), text, lambda value: value > 0, "more than 0")


def non_negative_number(text: str) -> float:
    return _checked(number(text), text, lambda value: value >= 0, "0 or more")


def _checked(value: N, text: str, ok: Callable[[N], bool], must_be: str) -> N:
    if not ok(value):
        raise ValueTextError(f"must be {must_be}, got {text!r}")
    return value


def positive_or_unset(text: str) -> int | None:
    """A variable's positive integer, where 0 (or nothing) means "not set": the default."""
    if not text.strip() or text.strip() == "0":
        return None
    return positive_int(text)


def host_address(text: str) -> str:
    """An IP address or a host name: where a service listens, or what its peers dial."""
    try:
        ipaddress.ip_address(text.removeprefix("[").removesuffix("]"))
        return text
    except ValueError:
        pass
    labels = text.removesuffix(".").split(".")
    if len(text) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels):
        return text
    raise ValueTextError(f"must be an IP address or a host name, got {text!r}")
