"""Llama / Qwen2 decoder forward over a flat batch of tokens with a paged KV cache."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.engine.kv_cache import KVCachePool
from kvmesh.engine.model import paged_kernel, small_batch
from kvmesh.engine.model.attention import AttentionMetadata, paged_attention, write_kv
from kvmesh.engine.model.config import ModelConfig
from kvmesh.engine.model.linear import Linear, can_prepack
from kvmesh.engine.model.weights import ModelWeights

logger = logging.getLogger(__name__)


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
        compiled = device.type == "cpu" and paged_kernel.available()
        small = small_batch.plan(weights, dtype, compiled, prepack and can_prepack(weights.embed))
        logger.info("small-batch linear kernel: %s", small.why)

        def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = small.layer_rows) -> Linear:
            return Linear(weight, bias, prepack=prepack, small_rows=rows, tile_rows=small.tile_rows, tile_kernel=small.tile_kernel)

        self.lm_head = make_linear(weights.lm_head, rows=small.lm_head_rows)
        self.layers = [
            DecoderLayer(
                input_norm=layer.input_norm,
                qkv=make_linear(layer.qkv, layer.qkv_bias),
                o_proj=make_linear(layer.o_proj),
                post_norm=layer.post_norm,
                gate_up=make_linear(layer.gate_up),
                down=make_linear(layer.down),
            )
            for layer in weights.layers
        ]
        self._plan = small
        if self.layers and self.layers[0].qkv.prepacked and not small.layer_rows:
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
        # Decode attention through the compiled kernel, K/V read in place (model/paged_kernel.py),
        # for every dtype: a decode step 1.25-1.34x (float32) and 1.28-1.38x (bfloat16) faster
        # than gathering the blocks at batch 1, 8 and 32 (docs/benchmarks.md, "The compiled
        # decode attention for float32").
        self.paged_kernel = compiled
        # Prefill attention (a chunk attending to itself and its earlier context) through the
        # compiled kernel where the CPU has no AMX, bfloat16 with AVX512-BF16 and float32 with
        # AVX-512, for the head shapes it is built for (paged_kernel.prefill_attention_wanted): a
        # 4 x 1,024-token prefill 1.42x (bfloat16) and 1.11x (float32) faster than with flash
        # attention on an AMD Zen 4 (docs/benchmarks.md, "A float32 prefill attention kernel, and
        # both dtypes' kernel in tiles of rows").
        group = config.num_heads // config.num_kv_heads
        self.prefill_kernel = compiled and paged_kernel.prefill_attention_wanted(config.head_dim, group, dtype)
        # Called before each layer after the first (AsyncEngine's, with --lend-cores: a step on
        # borrowed cores gives them back between layers when their owner turns busy).
        self.between_layers: Callable[[], None] | None = None
        # Rotary and the K/V store fused into one compiled op (same library), bit-identical.
        self.fused_rope = compiled
        # The residual add and RMSNorm in one op, silu-and-mul in one (csrc/fused_ops.cpp),
        # where PyTorch runs about a dozen small ops (docs/benchmarks.md, "Engine ablation").
        self.fused_elementwise = compiled
        # The norm each layer's output is normalized by: the next layer's input norm, the
        # final norm after the last.
        self.next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]

    def linears(self) -> list[Linear]:
        return [self.lm_head] + [lin for layer in self.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]

    @property
    def small_batch_linear(self) -> bool:
        """Do small batches go to the small-batch linear kernel (where the plan kept it)?"""
        return any(linear.small_rows for linear in self.linears())

    @small_batch_linear.setter
    def small_batch_linear(self, on: bool) -> None:  # the ablation's and the tests' switch
        self.lm_head.small_rows = self._plan.lm_head_rows if on else 0
        for linear in self.linears()[1:]:
            linear.small_rows = self._plan.layer_rows if on else 0

    @property
    def tile_linear(self) -> bool:
        """Do batches of up to the plan's ``tile_rows`` go to its tile kernel (AMX, or a packed one)?"""
        return any(linear.tile_rows for linear in self.linears())

    @tile_linear.setter
    def tile_linear(self, on: bool) -> None:  # the ablation's and the tests' switch
        for linear in self.linears():
            linear.tile_rows = self._plan.tile_rows if on else 0

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if self.fused_elementwise:
            return torch.ops.kvmesh.rms_norm(x, weight, eps)
        return F.rms_norm(x, (self.config.hidden_size,), weight, eps)

    def _add_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream plus ``delta``, and its RMSNorm by ``weight`` (fused: in place)."""
        eps = self.config.rms_norm_eps
        if self.fused_elementwise:
            return residual, torch.ops.kvmesh.add_rms_norm(residual, delta, weight, eps)
        residual = residual + delta
        return residual, F.rms_norm(residual, (self.config.hidden_size,), weight, eps)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = self.config.intermediate_size
        if self.fused_elementwise:
            return torch.ops.kvmesh.silu_mul(gate_up, inter)
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCachePool
    ) -> torch.Tensor:
        """Final hidden states (T, hidden) for the flat batch."""
        cfg = self.config
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        num_tokens = input_ids.shape[0]
        cos, sin = self.rotary.tables(positions)
        residual = F.embedding(input_ids, self.embed)  # a new tensor: the fused ops add into it in place
        h = self._norm(residual, self.layers[0].input_norm if self.layers else self.norm)
        for index, layer in enumerate(self.layers):
            if index and self.between_layers is not None:
                self.between_layers()
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
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.paged_kernel, index, self.prefill_kernel)
            residual, h = self._add_norm(residual, layer.o_proj(attn.view(num_tokens, self.q_size)), layer.post_norm)
            activated = self._silu_mul(layer.gate_up(h))
            residual, h = self._add_norm(residual, layer.down(activated), self.next_norms[index])
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
