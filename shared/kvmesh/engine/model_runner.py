"""Turns a scheduled step into tensors, runs the model and samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.engine.kv_cache import KVCachePool
from kvmesh.engine.kv_cache_manager import KVCacheManager, cdiv
from kvmesh.engine.logprobs import PromptSpan, record_prompt_logprobs, record_sample_logprobs
from kvmesh.engine.model import attention
from kvmesh.engine.model.attention import AttentionMetadata, DecodeBatch, PrefillSpan, SharedPrefill
from kvmesh.engine.model.llama import LlamaModel
from kvmesh.engine.request import Request
from kvmesh.engine.sampler import sample_rows
from kvmesh.engine.scheduler import SchedulerOutput


def shared_prefix_blocks(tables: list[list[int]], context_lens: list[int], block_size: int) -> int:
    """How many leading blocks every table has in common, leaving each sequence at least
    one token of its own after them."""
    limit = min((length - 1) // block_size for length in context_lens)
    first = tables[0]
    count = 0
    while count < limit and all(table[count] == first[count] for table in tables):
        count += 1
    return count


@dataclass(slots=True)
class _Chunk:
    """A prefill chunk that begins after cached (or earlier-computed) context."""

    flat_start: int
    start_pos: int
    end_pos: int
    table: list[int]  # its blocks up to end_pos


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_pool: KVCachePool,
        kv_manager: KVCacheManager,
        *,
        cascade_min_blocks: int = 8,
    ) -> None:
        """``cascade_min_blocks``: decode batches whose sequences share at least this many
        leading blocks read them once for the whole batch (cascade attention); so do two or
        more prefill chunks of one step whose cached contexts do (``SharedPrefill``), while
        ``shared_prefill`` is on (CPU only: it needs flash attention's log-sum-exp)."""
        self.cascade_min_blocks = cascade_min_blocks
        self.shared_prefill = model.device.type == "cpu"
        self.model = model
        self.kv_pool = kv_pool
        self.kv_manager = kv_manager
        self.block_size = kv_pool.layout.block_size
        self.device = model.device
        # The shared prefix's K/V as the last decode steps gathered them, per layer, while
        # consecutive steps share the same prefix (named by its blocks' ids and epochs, so a
        # block taken for new content since is never read from here): the prefix is gathered
        # once, not once a step. Kept only while the next step shares it.
        self.reuse_prefix_gather = True
        self._prefix_key: tuple[tuple[int, int], ...] | None = None
        self._prefix_kv: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Request]]:
        bs = self.block_size
        decodes = [item for item in out.scheduled if item.num_new_tokens == 1]
        prefills = [item for item in out.scheduled if item.num_new_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []

        tables: list[list[int]] = []
        context_lens: list[int] = []
        for row, item in enumerate(decodes):
            req = item.request
            pos = req.num_computed_tokens
            blocks = self.kv_manager.block_ids(req.request_id)
            input_ids.append(req.token_ids[pos])
            positions.append(pos)
            slot_blocks.append(blocks[pos // bs])
            slot_offsets.append(pos % bs)
            tables.append(blocks[: cdiv(pos + 1, bs)])
            context_lens.append(pos + 1)
            if item.samples:
                sample_rows.append(row)
                sample_reqs.append(req)
        decode = self._decode_batch(tables, context_lens) if decodes else None

        spans: list[PrefillSpan] = []
        continued: list[_Chunk] = []  # chunks after cached context: candidates for a SharedPrefill
        for item in prefills:
            req = item.request
            start_pos, count = req.num_computed_tokens, item.num_new_tokens
            end_pos = start_pos + count
            blocks = self.kv_manager.block_ids(req.request_id)
            flat_start = len(input_ids)
            input_ids.extend(req.token_ids[start_pos:end_pos])
            span_positions = range(start_pos, end_pos)
            positions.extend(span_positions)
            slot_blocks.extend(blocks[p // bs] for p in span_positions)
            slot_offsets.extend(p % bs for p in span_positions)
            if start_pos > 0:
                continued.append(_Chunk(flat_start, start_pos, end_pos, blocks[: cdiv(end_pos, bs)]))
            else:
                spans.append(PrefillSpan(flat_start, count, end_pos, None, None))
            if item.samples:
                sample_rows.append(flat_start + count - 1)
                sample_reqs.append(req)
        groups = self._shared_prefills(continued)
        grouped = {span.start for group in groups for span in group.spans}
        spans.extend(self._span(chunk, 0) for chunk in continued if chunk.flat_start not in grouped)

        meta = AttentionMetadata(
            slot_blocks=self._tensor(slot_blocks),
            slot_offsets=self._tensor(slot_offsets),
            num_decode=len(decodes),
            decode=decode,
            prefills=spans,
            shared_prefills=groups,
        )
        # The flat order is decodes first, then prefills: sampled tokens follow that order.
        out.scheduled = decodes + prefills
        return self._tensor(input_ids), self._tensor(positions), meta, sample_rows, sample_reqs

    def _span(self, chunk: _Chunk, skip_blocks: int) -> PrefillSpan:
        """The span of a chunk after cached context, attending to its context from block
        ``skip_blocks`` on (the blocks before are a ``SharedPrefill``'s prefix). A span that
        attends to just its own new tokens gets no block table: a causal square."""
        bs = self.block_size
        first = skip_blocks * bs
        count = chunk.end_pos - chunk.start_pos
        if chunk.start_pos == first:
            return PrefillSpan(chunk.flat_start, count, count, None, None)
        keys = torch.arange(first, chunk.end_pos, device=self.device)
        queries = torch.arange(chunk.start_pos, chunk.end_pos, device=self.device)
        visible = (keys.unsqueeze(0) <= queries.unsqueeze(1)).view(1, 1, count, -1)
        mask: torch.Tensor = visible
        if skip_blocks:  # flash attention's mask is additive, in the queries' dtype
            mask = torch.zeros(visible.shape, dtype=self.model.dtype, device=self.device)
            mask = mask.masked_fill_(~visible, float("-inf"))
        table = self._tensor(chunk.table[skip_blocks:])
        return PrefillSpan(chunk.flat_start, count, chunk.end_pos - first, table, mask)

    def _shared_prefills(self, chunks: list[_Chunk]) -> list[SharedPrefill]:
        """Groups of two or more chunks whose cached contexts begin with the same blocks
        (at least ``cascade_min_blocks`` of them, all before each chunk's first query)."""
        if not self.shared_prefill or attention.flash_attention_with_lse is None or len(chunks) < 2:
            return []
        by_first: dict[int, list[_Chunk]] = {}
        for chunk in chunks:
            by_first.setdefault(chunk.table[0], []).append(chunk)
        groups = []
        for members in by_first.values():
            if len(members) < 2:
                continue
            # the +1: a chunk's prefix may end exactly where its queries begin
            shared = shared_prefix_blocks([c.table for c in members], [c.start_pos + 1 for c in members], self.block_size)
            if shared < self.cascade_min_blocks:
                continue
            spans = [self._span(chunk, shared) for chunk in members]
            total = sum(span.length for span in spans)
            groups.append(SharedPrefill(self._tensor(members[0].table[:shared]), spans, total))
        return groups

    def _decode_batch(self, tables: list[list[int]], context_lens: list[int]) -> DecodeBatch:
        bs = self.block_size
        shared = shared_prefix_blocks(tables, context_lens, bs) if len(tables) > 1 else 0
        prefix = None
        prefix_kv = None
        if shared >= self.cascade_min_blocks:
            prefix = self._tensor(tables[0][:shared])
            prefix_kv = self._gathered_prefix(tables[0][:shared])
            tables = [table[shared:] for table in tables]
            context_lens = [length - shared * bs for length in context_lens]
        else:
            shared = 0
            self._prefix_key = self._prefix_kv = None
        width = max(len(t) for t in tables)
        block_tables = self._tensor([t + [0] * (width - len(t)) for t in tables]).view(len(tables), width)
        bias = None
        lens = self._tensor(context_lens) if self.model.paged_kernel else None
        if lens is None and min(context_lens) < width * bs:
            keys = torch.arange(width * bs, device=self.device)
            visible = keys.unsqueeze(0) < self._tensor(context_lens).unsqueeze(1)
            bias = torch.zeros(visible.shape, dtype=torch.float32, device=self.device)
            bias = bias.masked_fill_(~visible, float("-inf")).view(len(tables), 1, 1, -1)
        return DecodeBatch(block_tables, bias, prefix, lens, prefix_kv)

    def _gathered_prefix(self, block_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor] | None] | None:
        """The per-layer slots of the shared prefix's gathered K/V: the last step's (filled)
        when it shared the same blocks, unchanged since, else new empty ones."""
        if not self.reuse_prefix_gather:
            self._prefix_key = self._prefix_kv = None
            return None
        blocks = self.kv_manager.pool.blocks
        key = tuple((block_id, blocks[block_id].epoch) for block_id in block_ids)
        if key != self._prefix_key or self._prefix_kv is None:
            self._prefix_key, self._prefix_kv = key, [None] * self.model.config.num_layers
        return self._prefix_kv

    def execute(self, out: SchedulerOutput) -> list[int | Exception]:
        """Run one step; returns one sampled token per request that reached its last token,
        in the order of ``out.scheduled`` (which this reorders: decodes first), or the
        exception that sampling that request's row raised. Anything else raises."""
        input_ids, positions, meta, rows, reqs = self.prepare(out)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_pool)
        spans = _prompt_spans(out)
        if spans:
            record_prompt_logprobs(hidden, spans, self.model.logits)
        if not rows:
            return []
        logits = self.model.logits(hidden[self._tensor(rows)])
        chosen = sample_rows(logits, reqs)
        record_sample_logprobs(logits, reqs, chosen)
        return chosen


def _prompt_spans(out: SchedulerOutput) -> list[PromptSpan]:
    """The prefill chunks of requests that want prompt logprobs, at their rows of the flat
    batch (decodes first, one row each, then each prefill's tokens: ``prepare``'s order)."""
    spans: list[PromptSpan] = []
    flat = 0
    for item in out.scheduled:
        req = item.request
        if req.sampling.prompt_logprobs is not None and req.num_computed_tokens < req.num_prompt_tokens:
            if not req.prompt_logprobs_sent:
                spans.append(PromptSpan(req, flat, req.num_computed_tokens, item.num_new_tokens))
        flat += item.num_new_tokens
    return spans
