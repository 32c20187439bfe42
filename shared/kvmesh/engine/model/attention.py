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
    decode_bias: torch.Tensor | None  # (B, 1, 1, max_blocks * block_size) float32: 0 or -inf
    prefills: list[PrefillSpan]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store new K/V (T, kv_heads, head_dim) at their slots of the layer's cache views."""
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """K or V of the blocks in ``block_table`` (..., n) as (..., kv_heads, n*block_size, dim).

    ``index_select`` copies whole blocks, which is several times faster than advanced
    indexing on the strided per-layer view of the pool.
    """
    gathered = torch.index_select(cache, 0, block_table.reshape(-1))  # (N*n, block_size, kv_heads, dim)
    _, block_size, kv_heads, dim = gathered.shape
    tokens = gathered.view(*block_table.shape[:-1], block_table.shape[-1] * block_size, kv_heads, dim)
    return tokens.transpose(-3, -2).contiguous()


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per sequence: q (B, heads, dim), keys/values (B, kv_heads, S, dim).

    The query heads that share a KV head are stacked as rows of one small matmul, so K and
    V are never repeated. Softmax runs in float32, as Hugging Face's eager attention does.
    """
    batch, heads, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.view(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale + bias
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(batch, heads, dim)


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
        assert meta.decode_block_tables is not None and meta.decode_bias is not None
        keys = _gather(k_cache, meta.decode_block_tables)  # (B, kv_heads, S, dim)
        values = _gather(v_cache, meta.decode_block_tables)
        out[:num_decode] = _decode_attention(q[:num_decode], keys, values, meta.decode_bias, scale)
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
