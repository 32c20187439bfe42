"""Llama / Qwen2 decoder forward over a flat batch of tokens with a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.engine.kv_cache import KVCachePool
from kvmesh.engine.model import paged_kernel
from kvmesh.engine.model.attention import AttentionMetadata, paged_attention, write_kv
from kvmesh.engine.model.config import ModelConfig
from kvmesh.engine.model.linear import Linear
from kvmesh.engine.model.weights import ModelWeights


class RotaryEmbedding:
    """Rotary position embedding in the Hugging Face (rotate-half) layout."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, dtype: torch.dtype, device: torch.device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        half = head_dim // 2
        sin = emb.sin()
        sin[:, :half] = -sin[:, :half]  # rotate_half(x) * sin == roll(x, half) * signed_sin
        self.cos = emb.cos().to(dtype)
        self.signed_sin = sin.to(dtype)
        self.half = half

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for ``positions``, (T, 1, head_dim): once per step, not per layer."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, head_dim)."""
        return x * cos + torch.roll(x, self.half, dims=-1) * sin


@dataclass(slots=True)
class DecoderLayer:
    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        dtype: torch.dtype,
        device: torch.device,
        *,
        prepack: bool = True,
    ):
        self.config = config
        self.embed = weights.embed
        self.norm = weights.norm
        self.lm_head = Linear(weights.lm_head, prepack=prepack)
        self.layers = [
            DecoderLayer(
                input_norm=layer.input_norm,
                qkv=Linear(layer.qkv, layer.qkv_bias, prepack=prepack),
                o_proj=Linear(layer.o_proj, prepack=prepack),
                post_norm=layer.post_norm,
                gate_up=Linear(layer.gate_up, prepack=prepack),
                down=Linear(layer.down, prepack=prepack),
            )
            for layer in weights.layers
        ]
        if self.layers and self.layers[0].qkv.prepacked:
            for layer in self.layers:  # the prepacked copies are all that is used from here on
                for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                    linear.weight = None
        self.dtype = dtype
        self.device = device
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, dtype, device
        )
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        compiled = device.type == "cpu" and paged_kernel.available()
        # Decode attention through the compiled kernel, K/V read in place (model/paged_kernel.py),
        # for every dtype: a decode step 1.25-1.34x (float32) and 1.28-1.38x (bfloat16) faster
        # than gathering the blocks at batch 1, 8 and 32 (docs/benchmarks.md, "The compiled
        # decode attention for float32").
        self.paged_kernel = compiled
        # Rotary and the K/V store fused into one compiled op (same library), bit-identical.
        self.fused_rope = compiled

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCachePool
    ) -> torch.Tensor:
        """Final hidden states (T, hidden) for the flat batch."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        hidden_shape = (cfg.hidden_size,)
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        inter = cfg.intermediate_size
        num_tokens = input_ids.shape[0]
        cos, sin = self.rotary.tables(positions)
        x = F.embedding(input_ids, self.embed)
        residual = x
        for index, layer in enumerate(self.layers):
            h = F.rms_norm(x if index == 0 else residual, hidden_shape, layer.input_norm, eps)
            qkv = layer.qkv(h)
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, heads + kv_heads, head_dim)
            v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, kv_heads, head_dim)
            k_cache, v_cache = kv.layer_views(index)
            if self.fused_rope:  # one op: rotary in place on q and k, then K/V into their slots
                torch.ops.kvmesh.rope_store(qk, v, cos, sin, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets, heads)
            else:
                qk = self.rotary.apply(qk, cos, sin)
                write_kv(k_cache, v_cache, qk[:, heads:], v, meta)
            q, k = qk[:, :heads], qk[:, heads:]
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.paged_kernel)
            residual = residual + layer.o_proj(attn.view(num_tokens, self.q_size))
            h = F.rms_norm(residual, hidden_shape, layer.post_norm, eps)
            gate_up = layer.gate_up(h)
            residual = residual + layer.down(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        return F.rms_norm(residual, hidden_shape, self.norm, eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
