"""Model hyper-parameters, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from kvmesh.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {"llama", "qwen2"}


class UnsupportedModelError(ModelLoadError):
    pass


@dataclass(slots=True, frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        """The hyper-parameters of a ``config.json``'s contents; ``UnsupportedModelError`` names
        what is missing or of the wrong type."""
        if not isinstance(raw, dict):
            raise UnsupportedModelError("config.json is not a JSON object")
        try:
            return cls._from_dict(raw)
        except KeyError as exc:
            raise UnsupportedModelError(f"config.json has no {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
            raise UnsupportedModelError(f"config.json has a value of the wrong kind: {exc}") from None

    @classmethod
    def _from_dict(cls, raw: dict) -> ModelConfig:
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported (supported: {sorted(SUPPORTED_ARCHITECTURES)})"
            )
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
            raise UnsupportedModelError(f"rope_scaling {rope_scaling} is not supported yet")
        if raw.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention is not supported")
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_theta = raw.get("rope_theta")
        if rope_theta is None:
            rope_theta = (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{model_dir} has no config.json")
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UnsupportedModelError(f"{path} cannot be read as JSON: {exc}") from None
        return cls.from_dict(raw)
