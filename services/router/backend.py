"""What the router's HTTP layer needs from whatever generates tokens: one request in, its events out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.protocol import SamplingSpec, TokenEvent

__all__ = ["GenerationBackend", "HealthReport"]


@dataclass(frozen=True, slots=True)
class HealthReport:
    """Whether the backend can serve a request now.

    ``workers`` counts the live, ready workers by role (e.g. ``{"prefill": 1, "decode": 1}``);
    ``detail`` says why it is not ready (it becomes the 503's message).
    """

    ready: bool
    workers: dict[str, int] = field(default_factory=dict)
    detail: str = ""


@runtime_checkable
class GenerationBackend(Protocol):
    """A source of token streams for one served model.

    ``generate`` yields the request's ``TokenEvent``s in order (seq 0, 1, ...); the last has
    ``finished=True``, a ``finish_reason`` ("stop", "length" or "abort") and the prompt and cached
    token counts. It raises ``kvmesh.errors.MeshError`` on failure, before or during the stream.
    Leaving the iterator early (``aclose()`` or cancellation) cancels the request in the mesh.
    """

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        session_id: str | None = None,  # the client's x-session-id header, for session affinity
    ) -> AsyncIterator[TokenEvent]: ...

    async def health(self) -> HealthReport:
        """Whether a request can be served now, and the ready workers by role."""
        ...
