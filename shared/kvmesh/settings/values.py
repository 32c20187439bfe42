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
    value = integer(text)
    if value < 1:
        raise ValueTextError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise ValueTextError(f"must be 0 or more, got {text!r}")
    return value


def port_number(text: str) -> int:
    """A TCP port to listen on: 0 (a free one) to 65535."""
    value = integer(text)
    if not 0 <= value <= 65535:
        raise ValueTextError(f"must be a port number in 0..65535, got {text!r}")
    return value


def positive_number(text: str) -> float:
    """More than 0 and finite: seconds to wait, a rate."""
    value = number(text)
    if value <= 0:
        raise ValueTextError(f"must be more than 0, got {text!r}")
    return value


def non_negative_number(text: str) -> float:
    value = number(text)
    if value < 0:
        raise ValueTextError(f"must be 0 or more, got {text!r}")
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
