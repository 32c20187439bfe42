"""The model's own sampling defaults, from its ``generation_config.json``, for what a request omits.

As vLLM's ``--generation-config auto`` (its default): the keys ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` and
``max_new_tokens`` (the default ``max_tokens``, never beyond what the context has room for) are
used where a request leaves the field out or null; everything else in the file (``do_sample``,
token ids) is not a sampling default. ``vllm`` turns them off (OpenAI's neutral defaults), and a
directory reads that directory's file instead. A value outside what the API itself accepts is
dropped, with a warning.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

logger = logging.getLogger(__name__)

__all__ = ["GenerationDefaults"]

FILE = "generation_config.json"
@dataclass(frozen=True, slots=True)
class _Range:
    low: float
    high: float
    open_low: bool = False  # the lowest value itself is out
    integer: bool = False

    def holds(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.integer and not float(value).is_integer():
            return False
        return (value > self.low if self.open_low else value >= self.low) and value <= self.high


# generation_config.json key -> (request field, the values a request may have)
_KEYS: dict[str, tuple[str, _Range]] = {
    "temperature": ("temperature", _Range(0.0, 2.0)),
    "top_p": ("top_p", _Range(0.0, 1.0, open_low=True)),
    "top_k": ("top_k", _Range(-1, math.inf, integer=True)),
    "min_p": ("min_p", _Range(0.0, 1.0)),
    "repetition_penalty": ("repetition_penalty", _Range(0.0, 100.0, open_low=True)),
    "presence_penalty": ("presence_penalty", _Range(-2.0, 2.0)),
    "frequency_penalty": ("frequency_penalty", _Range(-2.0, 2.0)),
    "max_new_tokens": ("max_tokens", _Range(1, math.inf, integer=True)),
}

Body = TypeVar("Body", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Request field -> the model's default value; ``source`` names the file they came from."""

    values: dict[str, float | int] = field(default_factory=dict)
    source: str = ""

    @staticmethod
    def setting_problem(setting: str) -> str | None:
        """Why ``--generation-config`` cannot be ``setting`` (``None``: it can), said by the
        router's settings and by ``kvmesh up`` before anything starts."""
        if setting in ("auto", "vllm") or Path(setting).is_dir():
            return None
        return f"--generation-config {setting}: not auto, vllm or a directory"

    @classmethod
    def load(cls, setting: str, model_dir: str | Path) -> GenerationDefaults:
        """``setting``: ``auto`` (the model directory's file), ``vllm`` (none) or a directory."""
        if setting == "vllm":
            return cls()
        path = Path(model_dir if setting == "auto" else setting) / FILE
        if not path.is_file():
            if setting != "auto":
                logger.warning("--generation-config %s: no %s there; no generation defaults", setting, FILE)
            return cls()
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            logger.warning("%s is unreadable (%s): no generation defaults", path, exc)
            return cls()
        if not isinstance(config, dict):
            return cls()
        values: dict[str, float | int] = {}
        for key, (name, allowed) in _KEYS.items():
            value = config.get(key)
            if value is None:
                continue
            if not allowed.holds(value):
                logger.warning("%s: %s=%r is not a value requests may have; ignored", path, key, value)
                continue
            values[name] = int(value) if allowed.integer else float(value)
        return cls(values, str(path))

    def __bool__(self) -> bool:
        return bool(self.values)

    def describe(self) -> str:
        if not self.values:
            return "none (OpenAI's: temperature 1, top_p 1, no penalties)"
        return f"{self.values} from {self.source}"

    def apply(self, body: Body, prompt_lengths: list[int], max_model_len: int) -> Body:
        """``body`` with the defaults where it has none. The default ``max_tokens`` applies when no
        length was asked for, capped by the room the longest prompt leaves."""
        if not self.values:
            return body
        update: dict[str, Any] = {
            name: value for name, value in self.values.items() if name != "max_tokens" and getattr(body, name, 0) is None
        }
        default_max = self.values.get("max_tokens")
        if default_max is not None and getattr(body, "requested_max_tokens", 0) is None:
            room = max_model_len - max(prompt_lengths, default=0)
            if room >= 1:  # else the request is refused for its prompt, as without a default
                update["max_tokens"] = min(int(default_max), room)
        return body.model_copy(update=update) if update else body
