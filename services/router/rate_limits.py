"""Per-key rate limits, as configured: tokens per unit of time and concurrent requests.

The limits file (``--rate-limits FILE`` or ``KVMESH_RATE_LIMITS``), JSON or YAML::

    {"keys": {"alice": {"input_tokens_per_minute": 10000, "output_tokens_per_minute": 2000,
                        "max_concurrent": 4}},
     "default": {"input_tokens_per_minute": 1000}}

Each limits object may give ``input_tokens_per_<unit>``, ``output_tokens_per_<unit>`` (``unit``:
second, minute, hour or day; one unit per kind) and ``max_concurrent``; each is a positive
integer and each is optional (absent: unlimited). ``keys`` maps an API key's name to its limits;
``default`` applies to every other name, including ``anonymous`` (the caller when no keys are
configured). A name in neither is unlimited. Budgets are fixed windows aligned to the epoch
(a minute budget resets at every full minute). ``max_concurrent`` counts per router process;
token budgets are per router or, with the NATS store, shared by every router.
"""

from __future__ import annotations

import json
from kvmesh.settings.files import settings_text
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["UNITS", "KeyLimits", "RateLimitConfig", "RateLimitConfigError", "TokenRate", "load_rate_limits"]

UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
KINDS = ("input", "output")


class RateLimitConfigError(ValueError):
    """A limits file that cannot be used."""


@dataclass(frozen=True, slots=True)
class TokenRate:
    tokens: int  # per window
    window: int  # seconds

    @property
    def unit(self) -> str:
        return next(name for name, seconds in UNITS.items() if seconds == self.window)


@dataclass(frozen=True, slots=True)
class KeyLimits:
    input: TokenRate | None = None
    output: TokenRate | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True, slots=True)
class RateLimitConfig:
    keys: dict[str, KeyLimits] = field(default_factory=dict)
    default: KeyLimits | None = None

    def for_key(self, name: str) -> KeyLimits | None:
        return self.keys.get(name, self.default)

    @property
    def empty(self) -> bool:
        return not self.keys and self.default is None


def _positive(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RateLimitConfigError(f"{where} must be a positive integer, got {value!r}")
    return value


def parse_key_limits(where: str, raw: Any) -> KeyLimits:
    if not isinstance(raw, Mapping):
        raise RateLimitConfigError(f"{where} must be a mapping of limits")
    rates: dict[str, TokenRate] = {}
    concurrent = None
    for name, value in raw.items():
        if name == "max_concurrent":
            concurrent = _positive(f"{where}.max_concurrent", value)
            continue
        kind, _, unit = str(name).partition("_tokens_per_")
        if kind not in KINDS or unit not in UNITS:
            raise RateLimitConfigError(
                f"{where}: unknown limit {name!r} (use input_tokens_per_<unit>, output_tokens_per_<unit>"
                f" with unit one of {', '.join(UNITS)}, or max_concurrent)"
            )
        if kind in rates:
            raise RateLimitConfigError(f"{where}: two {kind} token limits")
        rates[kind] = TokenRate(_positive(f"{where}.{name}", value), UNITS[unit])
    return KeyLimits(rates.get("input"), rates.get("output"), concurrent)


def parse_rate_limits(raw: Any, source: str = "the limits file") -> RateLimitConfig:
    if not isinstance(raw, Mapping):
        raise RateLimitConfigError(f"{source}: must be a mapping with 'keys' and/or 'default'")
    unknown = set(raw) - {"keys", "default"}
    if unknown:
        raise RateLimitConfigError(f"{source}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    keys_raw = raw.get("keys") or {}
    if not isinstance(keys_raw, Mapping):
        raise RateLimitConfigError(f"{source}: 'keys' must map key names to limits")
    keys = {str(name): parse_key_limits(f"keys.{name}", limits) for name, limits in keys_raw.items()}
    default = raw.get("default")
    return RateLimitConfig(keys, None if default is None else parse_key_limits("default", default))


def load_rate_limits(path: str) -> RateLimitConfig:
    try:
        text = settings_text(path)
    except OSError as exc:
        raise RateLimitConfigError(f"cannot read the limits file {path}: {exc.strerror or exc}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise RateLimitConfigError(f"{path} is neither JSON nor YAML: {exc}") from None
    return parse_rate_limits(raw, path)
