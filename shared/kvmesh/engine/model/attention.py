"""Paged attention: K/V are written into, and read back through, each sequence's blocks.

One step's tokens are flat: first one token per decoding sequence, then the chunks of the
sequences being prefilled. Per layer, every new K/V is stored into the pool before any
attention reads it, so a sequence that found a block in the prefix cache this very step
reads finished data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's prefill chunk: queries ``[start, start+length)`` of the flat batch."""

    start: int
    length: int
    context_len: int  # tokens the chunk attends to, itself included
    block_table: torch.Tensor | None  # None: no earlier context, attend to the chunk itself
    mask: torch.Tensor | None  # (1, 1, length, context_len) when block_table is set


@dataclass(slots=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor  # (T,) block id for each new token's K/V
    slot_offsets: torch.Tensor  # (T,) offset inside that block
    num_decode: int  # the first num_decode tokens decode, one token per sequence
    decode_block_tables: torch.Tensor | None  # (B, max_blocks)
    decode_mask: torch.Tensor | None  # (B, 1, 1, max_blocks * block_size)
    prefills: list[PrefillSpan]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store new K/V (T, kv_heads, head_dim) at their slots of the layer's cache views."""
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """K or V of the blocks in ``block_table`` (..., n) as (..., kv_heads, n*block_size, dim)."""
    gathered = cache[block_table]  # (..., n, block_size, kv_heads, dim)
    shape = gathered.shape
    flat = gathered.reshape(*shape[:-4], shape[-4] * shape[-3], shape[-2], shape[-1])
    return flat.transpose(-3, -2)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of the flat batch; q (T, heads, dim), k/v (T, kv_heads, dim) -> (T, heads, dim)."""
    out = torch.empty_like(q)
    num_decode = meta.num_decode
    if num_decode:
        assert meta.decode_block_tables is not None
        keys = _gather(k_cache, meta.decode_block_tables)  # (B, kv_heads, S, dim)
        values = _gather(v_cache, meta.decode_block_tables)
        queries = q[:num_decode].unsqueeze(2)  # (B, heads, 1, dim)
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        out[:num_decode] = attended.squeeze(2)
    for span in meta.prefills:
        end = span.start + span.length
        queries = q[span.start : end].transpose(0, 1).unsqueeze(0)  # (1, heads, L, dim)
        if span.block_table is None:
            keys = k[span.start : end].transpose(0, 1).unsqueeze(0)
            values = v[span.start : end].transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            keys = _gather(k_cache, span.block_table)[:, : span.context_len].unsqueeze(0)
            values = _gather(v_cache, span.block_table)[:, : span.context_len].unsqueeze(0)
            attended = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=span.mask, scale=scale, enable_gqa=True
            )
        out[span.start : end] = attended.squeeze(0).transpose(0, 1)
    return out
