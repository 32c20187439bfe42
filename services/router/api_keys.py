"""The router's API keys: named keys read from a file or the environment, never from argv.

The key file (``--api-key-file PATH`` or ``KVMESH_API_KEY_FILE``; a mounted Kubernetes Secret is
such a file) holds one key a line::

    # comments and blank lines are ignored
    alice:sk-alice-0123456789
    bob:sk-bob-9876543210
    sk-a-bare-key-is-named-default

A line ``name:key`` names its key (a name is 1-64 of ``A-Z a-z 0-9 _ -``); a line without a
``:`` is the key named ``default``. Surrounding whitespace is stripped. ``KVMESH_API_KEY`` adds
one more key, named ``default``. Names and keys must be unique. The name, never the key, goes
on the request's metrics and log lines; keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import os
import re
from collections.abc import Mapping

from kvmesh.settings.env import API_KEY
from kvmesh.settings.files import settings_text

__all__ = ["ANONYMOUS", "DEFAULT_NAME", "ApiKeyError", "ApiKeys", "load_api_keys", "parse_key_file"]

DEFAULT_NAME = "default"
ANONYMOUS = "anonymous"  # the caller's name when no keys are configured
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ApiKeyError(ValueError):
    """A key file or key variable that cannot be used."""


class ApiKeys:
    """Key name -> key. ``identify`` finds the name of a presented key, in constant time."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        if not keys:
            raise ApiKeyError("no API keys given")
        for name, key in keys.items():
            if not NAME.fullmatch(name):
                raise ApiKeyError(f"bad API key name {name!r}: use 1-64 of A-Z a-z 0-9 _ -")
            if not key:
                raise ApiKeyError(f"the API key named {name!r} is empty")
        if len(set(keys.values())) != len(keys):
            raise ApiKeyError("two API key names have the same key")
        self._keys = [(name, key.encode()) for name, key in keys.items()]

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self._keys]

    def identify(self, presented: bytes) -> str | None:
        """The name of the key ``presented`` is, or None. Every key is compared, whatever matches."""
        found = None
        for name, key in self._keys:
            if hmac.compare_digest(presented, key) and found is None:
                found = name
        return found


def parse_key_file(text: str, source: str = "the key file") -> dict[str, str]:
    keys: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = line.partition(":")
        name, key = (name.strip(), key.strip()) if sep else (DEFAULT_NAME, line)
        if not NAME.fullmatch(name):
            raise ApiKeyError(f"{source} line {number}: bad key name (use 1-64 of A-Z a-z 0-9 _ -)")
        if not key:
            raise ApiKeyError(f"{source} line {number}: the key named {name!r} is empty")
        if name in keys:
            raise ApiKeyError(f"{source} line {number}: the name {name!r} is given twice")
        keys[name] = key
    return keys


def load_api_keys(path: str | None, env: Mapping[str, str] = os.environ) -> ApiKeys | None:
    """The keys from ``path`` (None: none) and ``KVMESH_API_KEY``; None when there are none."""
    keys: dict[str, str] = {}
    if path:
        try:
            text = settings_text(path)
        except OSError as exc:
            raise ApiKeyError(f"cannot read the API key file {path}: {exc.strerror or exc}") from None
        keys = parse_key_file(text, path)
    single = (API_KEY.raw(env) or "").strip()
    if single:
        if DEFAULT_NAME in keys:
            raise ApiKeyError(f"KVMESH_API_KEY and {path} both give the key named {DEFAULT_NAME!r}")
        keys[DEFAULT_NAME] = single
    return ApiKeys(keys) if keys else None
