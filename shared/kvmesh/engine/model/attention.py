"""Paged attention: K/V are written into, and read back through, each sequence's blocks.

One step's tokens are flat: first one token per decoding sequence, then the chunks of the
sequences being prefilled. Per layer, every new K/V is stored into the pool before any
attention reads it, so a sequence that found a block in the prefix cache this very step
reads finished data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
class SharedPrefill:
    """Prefill chunks whose contexts all begin with the same cached blocks (many prompts
    on one system prompt or document, prefilled in the same step).

    Every query of every chunk attends to those blocks in one unmasked flash attention, so
    they are read once for the group, not once per chunk; then each chunk attends to its
    own tokens after them, and the two parts merge by their log-sum-exp. Each span's
    ``block_table``, ``context_len`` and ``mask`` cover only the tokens after the prefix;
    ``block_table`` None: those are exactly the chunk's own new tokens (a causal square).
    """

    prefix: torch.Tensor  # (P,) block ids every span's context begins with, all before every span's queries
    spans: list[PrefillSpan]
    num_tokens: int  # the spans' queries, in all


# Flash attention that also returns each query's log-sum-exp (CPU); None: groups are not formed.
flash_attention_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(slots=True)
class DecodeBatch:
    """The sequences that attend with one query each (the first B tokens of the batch).

    When every sequence starts with the same blocks (a shared system prompt, a document
    many questions are asked about), those blocks are ``shared_prefix`` and are read once
    for the whole batch (cascade attention); ``block_tables`` then hold only the rest.
    """

    block_tables: torch.Tensor  # (B, n) block ids after the shared prefix, padded
    bias: torch.Tensor | None  # (B, 1, 1, n * block_size) float32, 0 or -inf; None: masked by context_lens if set, else nothing
    shared_prefix: torch.Tensor | None = None  # (P,) block ids every sequence begins with
    context_lens: torch.Tensor | None = None  # (B,) int64 tokens each attends to; set: the kernel may run
    # Per layer, the shared prefix's K/V once gathered (filled by the first step that gathers
    # them, reused by the next steps on the same blocks: ModelRunner); None: gathered each step.
    prefix_kv: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None


@dataclass(slots=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor  # (T,) block id for each new token's K/V
    slot_offsets: torch.Tensor  # (T,) offset inside that block
    num_decode: int  # the first num_decode tokens decode, one token per sequence
    decode: DecodeBatch | None
    prefills: list[PrefillSpan]
    shared_prefills: list[SharedPrefill] = field(default_factory=list)


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


def _gather_view(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Like ``_gather`` but (kv_heads, n*block_size, dim) as a strided view of the copied
    blocks, not made contiguous: flash attention reads it as it is, and the copy that
    transposing would take costs as much as the gather (float32)."""
    gathered = torch.index_select(cache, 0, block_table)  # (n, block_size, kv_heads, dim)
    kv_heads, dim = gathered.shape[2:]
    return gathered.view(-1, kv_heads, dim).transpose(0, 1)


def _context_rows(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """K or V of a chunk's context as (context_len, kv_heads, dim): the blocks copied in their
    own layout (one ``index_select``), the prefill kernel's rows."""
    return torch.index_select(cache, 0, block_table).flatten(0, 1)[:context_len]


def _span_kernel_kv(
    span: PrefillSpan, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V rows a prefill span attends to, as the prefill kernel takes them: its own
    rows of ``k``/``v`` when it has no earlier context, else its context's blocks (this chunk's
    own K/V among them: they are stored before attention)."""
    if span.block_table is None:
        rows = slice(span.start, span.start + span.length)
        return k[rows], v[rows]
    return _context_rows(k_cache, span.block_table, span.context_len), _context_rows(v_cache, span.block_table, span.context_len)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: DecodeBatch,
    scale: float,
    kernel: bool = False,
    layer: int = 0,
) -> torch.Tensor:
    """One query per sequence: q (B, heads, dim) -> (B, heads, dim).

    ``kernel``: the compiled kernel (paged_kernel.py) reads K/V in place, scores and sums in
    float32. Otherwise the blocks are gathered and the query heads that share a KV head are
    stacked as rows of one small matmul, so K and V are never repeated; softmax runs in
    float32, as Hugging Face's eager attention does. A shared prefix (cascade) is read once
    for the batch by flash attention (CPU), and merged by log-sum-exp with each sequence's
    attention to its own tokens (the kernel's, or the gathered path's).
    """
    flash = flash_attention_with_lse is not None and q.device.type == "cpu"
    if kernel and batch.context_lens is not None:
        if batch.shared_prefix is None:
            return torch.ops.kvmesh.paged_decode(q, k_cache, v_cache, batch.block_tables, batch.context_lens, scale)
        if flash:
            own_out, own_lse = torch.ops.kvmesh.paged_decode_lse(
                q, k_cache, v_cache, batch.block_tables, batch.context_lens, scale
            )
            prefix_kv = _prefix_kv(k_cache, v_cache, batch, layer)
            prefix_out, prefix_lse = _prefix_attention(q, k_cache, v_cache, batch.shared_prefix, scale, prefix_kv)
            return _merge(prefix_out, prefix_lse.unsqueeze(-1), own_out, own_lse.unsqueeze(-1)).to(q.dtype)
    num_seqs, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    grouped = q.view(num_seqs, kv_heads, group, dim)
    keys = _gather(k_cache, batch.block_tables)  # (B, kv_heads, S, dim)
    values = _gather(v_cache, batch.block_tables)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale  # (B, kv_heads, group, S)
    if batch.bias is not None:
        scores = scores + batch.bias
    elif batch.context_lens is not None:  # built for the kernel, which did not run: mask from the lengths
        visible = torch.arange(keys.shape[-2], device=q.device) < batch.context_lens.unsqueeze(1)
        scores = scores.masked_fill(~visible.view(num_seqs, 1, 1, -1), float("-inf"))
    if batch.shared_prefix is None:
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).view(num_seqs, heads, dim)

    dtype = values.dtype
    if flash:
        own_lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, kv_heads, group, 1)
        own_out = torch.matmul(torch.exp(scores - own_lse).to(dtype), values).view(num_seqs, heads, dim)
        prefix_kv = _prefix_kv(k_cache, v_cache, batch, layer)
        prefix_out, prefix_lse = _prefix_attention(q, k_cache, v_cache, batch.shared_prefix, scale, prefix_kv)
        own_lse = own_lse.view(num_seqs, heads, 1)
        return _merge(prefix_out, prefix_lse.unsqueeze(-1), own_out, own_lse).to(dtype)

    # Cascade elsewhere: the prefix in one matmul per KV head, then one softmax over
    # [prefix, own tokens] without concatenating them.
    stacked = grouped.transpose(0, 1).reshape(kv_heads, num_seqs * group, dim)
    prefix_keys = _gather(k_cache, batch.shared_prefix)  # (kv_heads, P, dim)
    prefix_values = _gather(v_cache, batch.shared_prefix)
    prefix_scores = torch.matmul(stacked, prefix_keys.transpose(-1, -2)).float() * scale  # (kv_heads, B*group, P)
    prefix_scores = prefix_scores.view(kv_heads, num_seqs, group, -1).transpose(0, 1)  # (B, kv_heads, group, P)
    peak = torch.maximum(prefix_scores.amax(-1, keepdim=True), scores.amax(-1, keepdim=True))
    prefix_weights = torch.exp(prefix_scores - peak)
    own_weights = torch.exp(scores - peak)
    total = prefix_weights.sum(-1, keepdim=True) + own_weights.sum(-1, keepdim=True)
    stacked_weights = prefix_weights.transpose(0, 1).reshape(kv_heads, num_seqs * group, -1).to(dtype)
    prefix_out = torch.matmul(stacked_weights, prefix_values).view(kv_heads, num_seqs, group, dim).transpose(0, 1)
    own_out = torch.matmul(own_weights.to(dtype), values)
    out = (prefix_out.float() + own_out.float()) / total
    return out.to(dtype).reshape(num_seqs, heads, dim)


def _prefix_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, layer: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The decode batch's shared prefix's K/V of this layer as (1, kv_heads, P, dim) views:
    gathered by an earlier step (``batch.prefix_kv``), or now, and kept there; None when the
    batch keeps none."""
    slots = batch.prefix_kv
    if slots is None or batch.shared_prefix is None:
        return None
    gathered = slots[layer]
    if gathered is None:
        gathered = slots[layer] = (
            _gather_view(k_cache, batch.shared_prefix).unsqueeze(0),
            _gather_view(v_cache, batch.shared_prefix).unsqueeze(0),
        )
    return gathered


def _prefix_attention(
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix: torch.Tensor,
    scale: float,
    gathered: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries rows (N, heads, dim) against every token of the ``prefix`` blocks, unmasked, by
    flash attention with the query heads that share a KV head stacked as its rows (no K/V
    repeat): the output (N, heads, dim) and each row's log-sum-exp (N, heads) float32.
    ``gathered``: the prefix's K/V already gathered (``_prefix_kv``)."""
    assert flash_attention_with_lse is not None
    num_rows, heads, dim = rows.shape
    kv_heads = k_cache.shape[2]
    per_kv = heads // kv_heads
    stacked = rows.reshape(num_rows, kv_heads, per_kv, dim).transpose(0, 1).reshape(1, kv_heads, num_rows * per_kv, dim)
    if gathered is not None:
        keys, values = gathered
    else:
        keys = _gather_view(k_cache, prefix).unsqueeze(0)  # (1, kv_heads, P, dim)
        values = _gather_view(v_cache, prefix).unsqueeze(0)
    out, lse = flash_attention_with_lse(stacked, keys, values, scale=scale)
    out = out.view(kv_heads, num_rows, per_kv, dim).transpose(0, 1).reshape(num_rows, heads, dim)
    return out, lse.view(kv_heads, num_rows, per_kv).transpose(0, 1).reshape(num_rows, heads)


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over keys A and B from each part's normalized output and log-sum-exp (the
    lse broadcast over the last dim of the outputs), in float32."""
    peak = torch.maximum(lse_a, lse_b)
    weight_a = torch.exp(lse_a - peak)
    weight_b = torch.exp(lse_b - peak)
    return (out_a.float() * weight_a + out_b.float() * weight_b) / (weight_a + weight_b)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernel: bool = False,
    layer: int = 0,
    prefill_kernel: bool = False,
) -> torch.Tensor:
    """Attention of the flat batch; q (T, heads, dim), k/v (T, kv_heads, dim) -> (T, heads, dim).
    ``kernel``: decode attention through the compiled kernel (see ``_decode_attention``);
    ``layer``: which of the decode batch's kept prefix K/V (``DecodeBatch.prefix_kv``) is this one's;
    ``prefill_kernel``: a bfloat16 chunk, alone or after earlier context, goes to the compiled
    ``prefill_attention`` (csrc/prefill_attention.cpp) instead of flash attention, and both
    parts of a ``SharedPrefill`` group to ``prefill_attention_lse``."""
    num_decode = meta.num_decode
    if not meta.prefills and not meta.shared_prefills:
        assert meta.decode is not None
        return _decode_attention(q, k_cache, v_cache, meta.decode, scale, kernel, layer)
    out = torch.empty_like(q)
    if num_decode:
        assert meta.decode is not None
        out[:num_decode] = _decode_attention(q[:num_decode], k_cache, v_cache, meta.decode, scale, kernel, layer)
    for group in meta.shared_prefills:
        _shared_prefill_attention(q, k, v, k_cache, v_cache, group, scale, out, prefill_kernel)
    for span in meta.prefills:
        end = span.start + span.length
        if prefill_kernel:
            rows = slice(span.start, end)
            keys, values = _span_kernel_kv(span, k, v, k_cache, v_cache)
            out[rows] = torch.ops.kvmesh.prefill_attention(q[rows], keys, values, scale)
            continue
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


def _shared_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: SharedPrefill,
    scale: float,
    out: torch.Tensor,
    prefill_kernel: bool = False,
) -> None:
    """Attention of a ``SharedPrefill`` group, written into its rows of ``out``; both parts
    through the compiled ``prefill_attention_lse`` with ``prefill_kernel``."""
    rows = torch.cat([q[span.start : span.start + span.length] for span in group.spans])  # (N, heads, dim)
    if prefill_kernel:
        prefix_len = group.prefix.numel() * k_cache.shape[1]
        prefix_keys, prefix_values = _context_rows(k_cache, group.prefix, prefix_len), _context_rows(v_cache, group.prefix, prefix_len)
        prefix_out, prefix_lse = torch.ops.kvmesh.prefill_attention_lse(rows, prefix_keys, prefix_values, scale, False)
    else:
        prefix_out, prefix_lse = _prefix_attention(rows, k_cache, v_cache, group.prefix, scale)

    own_out = torch.empty_like(prefix_out)
    own_lse = torch.empty_like(prefix_lse)
    row = 0
    for span in group.spans:
        end = span.start + span.length
        own = slice(row, row + span.length)
        row += span.length
        if prefill_kernel:
            keys, values = _span_kernel_kv(span, k, v, k_cache, v_cache)
            own_out[own], own_lse[own] = torch.ops.kvmesh.prefill_attention_lse(q[span.start : end], keys, values, scale, True)
            continue
        assert flash_attention_with_lse is not None
        per_kv = q.shape[1] // k_cache.shape[2]
        queries = q[span.start : end].transpose(0, 1).unsqueeze(0)  # (1, heads, L, dim)
        if span.block_table is None:
            keys, values = k[span.start : end].transpose(0, 1), v[span.start : end].transpose(0, 1)
        else:
            keys = _gather_view(k_cache, span.block_table)[:, : span.context_len]
            values = _gather_view(v_cache, span.block_table)[:, : span.context_len]
        keys = keys.repeat_interleave(per_kv, dim=0).unsqueeze(0)  # (1, heads, S, dim)
        values = values.repeat_interleave(per_kv, dim=0).unsqueeze(0)
        attended, lse = flash_attention_with_lse(
            queries, keys, values, is_causal=span.mask is None, attn_mask=span.mask, scale=scale
        )
        own_out[own] = attended.squeeze(0).transpose(0, 1)
        own_lse[own] = lse.squeeze(0).transpose(0, 1)

    merged = _merge(prefix_out, prefix_lse.unsqueeze(-1), own_out, own_lse.unsqueeze(-1)).to(q.dtype)
    row = 0
    for span in group.spans:
        out[span.start : span.start + span.length] = merged[row : row + span.length]
        row += span.length
