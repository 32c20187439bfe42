"""What a request's progress looks like from outside the engine: its outputs and, for a
prefill kept for export, the blocks that hold its KV; and what an observer of its steps is
told (``StepObserver``). Plain data, free of torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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


class StepObserver(Protocol):
    """Told of every request and engine step as they happen (metrics): ``arrived`` and
    ``closed`` on the event loop, ``imported`` and ``stepped`` on the engine thread."""

    def arrived(self, request_id: str) -> None: ...

    def imported(self, output: RequestOutput) -> None:
        """The first output of a request decoded from imported KV (its token was sampled
        by the prefill worker)."""
        ...

    def stepped(self, outputs: list[RequestOutput], seconds: float, preemptions: int) -> None:
        """One model step took ``seconds`` and gave ``outputs``; ``preemptions``: the
        engine's total so far."""
        ...

    def closed(self, request_id: str) -> None: ...
