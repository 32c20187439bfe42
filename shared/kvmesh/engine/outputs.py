"""What a request's progress looks like from outside the engine: its outputs and, for a
prefill kept for export, the blocks that hold its KV. Plain data, free of torch."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.engine.kv_layout import KVLayout
from kvmesh.engine.request import FinishReason, TokenLogprob
from kvmesh.errors import ErrorCode


@dataclass(slots=True, frozen=True)
class KVExport:
    """KV of a finished prefill, held in this engine's blocks until released."""

    block_ids: tuple[int, ...]
    num_tokens: int
    layout: KVLayout


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str  # new text since the previous output
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_export: KVExport | None = None
    queue_seconds: float | None = None  # arrival to first schedule; on the first output only
    error: str | None = None  # with FinishReason.ERROR: what failed, for the client
    # With FinishReason.ERROR: ``request_failed`` when this request's own sampling or output
    # failed (it would anywhere); ``internal`` when its whole step did (a co-batched
    # request, the device): another worker may well succeed.
    error_code: ErrorCode | None = None
    # With ``logprobs``: one per token of ``new_token_ids`` (None: not computed here, as an
    # import's first token). With ``prompt_logprobs``: every prompt token's (the first None),
    # on the output that finished the prompt.
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
