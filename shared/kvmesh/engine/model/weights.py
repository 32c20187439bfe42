"""Load a Hugging Face checkpoint's safetensors into the engine's fused weight layout."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kvmesh.engine.model.config import ModelConfig
from kvmesh.errors import ModelLoadError

logger = logging.getLogger(__name__)


class WeightsError(ModelLoadError):
    pass


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # (q_dim + 2 * kv_dim, hidden): q, k and v projections stacked
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # (2 * intermediate, hidden): gate then up
    down: torch.Tensor


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # the embedding itself when tied


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no safetensors files in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
    return tensors


def load_weights(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    raw = _read_safetensors(Path(model_dir))

    def take(name: str) -> torch.Tensor:
        try:
            tensor = raw.pop(name)
        except KeyError:
            raise WeightsError(f"checkpoint in {model_dir} lacks {name}") from None
        return tensor.to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        attn = prefix + "self_attn."
        qkv = torch.cat([take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight")])
        bias = None
        if config.attention_bias:
            bias = torch.cat([take(attn + "q_proj.bias"), take(attn + "k_proj.bias"), take(attn + "v_proj.bias")])
        layers.append(
            LayerWeights(
                input_norm=take(prefix + "input_layernorm.weight"),
                qkv=qkv,
                qkv_bias=bias,
                o_proj=take(attn + "o_proj.weight"),
                post_norm=take(prefix + "post_attention_layernorm.weight"),
                gate_up=torch.cat([take(prefix + "mlp.gate_proj.weight"), take(prefix + "mlp.up_proj.weight")]),
                down=take(prefix + "mlp.down_proj.weight"),
            )
        )
    embed = take("model.embed_tokens.weight")
    norm = take("model.norm.weight")
    if config.tie_word_embeddings or "lm_head.weight" not in raw:
        lm_head = embed
    else:
        lm_head = take("lm_head.weight")
    rotary_leftovers = [k for k in raw if "rotary_emb" in k]
    for key in rotary_leftovers:
        raw.pop(key)
    if raw:
        logger.warning("ignored %d unexpected tensors, e.g. %s", len(raw), sorted(raw)[:3])
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
