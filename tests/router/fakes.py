"""A scripted ``GenerationBackend`` for the router's tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import MeshError
from kvmesh.protocol import SamplingSpec, TokenEvent
from kvmesh.services.router.backend import HealthReport


@dataclass(frozen=True)
class Emit:
    """One TokenEvent with new tokens and their text."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Finish:
    """The final TokenEvent (it may carry tokens too)."""

    reason: str = "stop"
    num_cached_tokens: int = 0
    token_ids: tuple[int, ...] = ()
    text: str = ""


@dataclass(frozen=True)
class Fail:
    """Raise ``MeshError(code, message)`` at this point of the stream."""

    code: str
    message: str


@dataclass(frozen=True)
class Sleep:
    seconds: float


Step = Emit | Finish | Fail | Sleep


@dataclass(frozen=True)
class Call:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    session_id: str | None = None


@dataclass
class FakeBackend:
    """Plays ``script`` for every request; records calls, cancellations and completions.

    A request counts as cancelled when its iterator is left (``aclose`` or cancellation)
    before the ``Finish`` event was handed out, and not because of a scripted ``Fail``; the
    record is made after awaiting ``cancel_seconds``, so a cleanup that cannot await is caught.
    """

    tokenizer: Tokenizer
    script: list[Step] = field(default_factory=lambda: [Emit((5,), "Hi"), Finish("stop")])
    model_name: str = "tiny-llama"
    max_model_len: int = 64
    workers: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})  # ready, by role
    ready: bool = True
    detail: str = ""  # why not ready
    health_error: Exception | None = None  # health() raises this
    health_seconds: float = 0.0  # health() takes this long
    cancel_seconds: float = 0.0  # awaited before a cancellation is recorded
    calls: list[Call] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)  # set at the first event of any request

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *, session_id: str | None = None
    ) -> AsyncIterator[TokenEvent]:
        self.calls.append(Call(request_id, list(prompt_token_ids), sampling, session_id))
        return self._play(request_id, len(prompt_token_ids))

    async def _play(self, request_id: str, num_prompt_tokens: int) -> AsyncIterator[TokenEvent]:
        done = False
        seq = 0
        try:
            for step in self.script:
                if isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                elif isinstance(step, Fail):
                    done = True
                    raise MeshError(step.code, step.message)
                elif isinstance(step, Emit):
                    self.started.set()
                    yield TokenEvent(
                        request_id=request_id, seq=seq, token_ids=list(step.token_ids), text=step.text
                    )
                    seq += 1
                else:
                    done = True
                    self.finished.append(request_id)
                    yield TokenEvent(
                        request_id=request_id,
                        seq=seq,
                        token_ids=list(step.token_ids),
                        text=step.text,
                        finished=True,
                        finish_reason=step.reason,
                        num_prompt_tokens=num_prompt_tokens,
                        num_cached_tokens=step.num_cached_tokens,
                    )
                    return
            done = True  # the script ran out without a Finish: a broken stream, not a cancel
        finally:
            if not done:
                if self.cancel_seconds:  # like a real backend telling the mesh to cancel
                    await asyncio.sleep(self.cancel_seconds)
                self.cancelled.append(request_id)

    async def health(self) -> HealthReport:
        if self.health_seconds:
            await asyncio.sleep(self.health_seconds)
        if self.health_error is not None:
            raise self.health_error
        return HealthReport(self.ready, dict(self.workers), self.detail)
