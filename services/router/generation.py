"""Running one validated generation request against the backend and shaping its answer.

A request has one choice per prompt (completions may send a list of prompts; chat has one):
each choice is a request of its own in the mesh, with its own id, rate-limit admission and
tracker, started together and answered together, as one JSON object with a choice per prompt
(``index`` in prompt order) or as one SSE stream whose chunks name their choice's ``index``.
Should one choice fail, the others are cancelled and the request answers that failure.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvmesh.protocol import TokenEvent
from kvmesh.services.router.auth import key_name
from kvmesh.services.router.backend import GenerationBackend
from kvmesh.services.router.metrics import RequestTracker, RouterMetrics
from kvmesh.services.router.openai_api import (
    APIError,
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
    Usage,
)
from kvmesh.services.router.prompts import check_logit_bias, check_min_tokens, resolve_max_tokens
from kvmesh.services.router.rate_limit import RateLimiter
from kvmesh.services.router.shutdown import Shutdown
from kvmesh.services.router.streaming import (
    CLIENT_CLOSED,
    EventStream,
    EventStreamResponse,
    StreamedChoice,
    aclose,
    as_api_error,
    check_event,
    unless_disconnected,
)

__all__ = ["COMPLETIONS", "CHAT_COMPLETIONS", "SESSION_HEADER", "Generation"]

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
SESSION_HEADER = "x-session-id"

T = TypeVar("T")


@dataclass(slots=True)
class _Choice:
    """One prompt's request in the mesh."""

    events: AsyncIterator[TokenEvent]
    tracker: RequestTracker


def _failed(tracker: RequestTracker, exc: BaseException) -> APIError | None:
    """Record a request that ended in ``exc``: the error to answer with, or None to re-raise ``exc``."""
    if not isinstance(exc, Exception):  # cancelled: the client or the server went away
        tracker.finish(CLIENT_CLOSED)
        return None
    error = as_api_error(exc, tracker.request_id)
    tracker.finish(error.status)
    return error


async def _all_or_none(works: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Every result in order; should one raise, the others are cancelled and the first
    failure (in order) is raised."""
    tasks = [asyncio.ensure_future(work()) for work in works]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    return [task.result() for task in tasks]


class Generation:
    """Runs one validated request against the backend and shapes its answer."""

    def __init__(
        self, backend: GenerationBackend, metrics: RouterMetrics, shutdown: Shutdown, limiter: RateLimiter | None
    ) -> None:
        self.backend = backend
        self.metrics = metrics
        self.shutdown = shutdown
        self.limiter = limiter

    async def serve(
        self,
        request: Request,
        endpoint: str,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
    ) -> Response:
        param = "prompt" if endpoint == COMPLETIONS else "messages"
        budgets = [
            resolve_max_tokens(len(ids), body.requested_max_tokens, self.backend.max_model_len, param=param)
            for ids in prompts
        ]
        check_min_tokens(body.min_tokens, budgets)
        check_logit_bias(body.logit_bias, self.backend.tokenizer.vocab_size)
        request_id = uuid.uuid4().hex
        fmt_cls = CompletionFormat if endpoint == COMPLETIONS else ChatFormat
        fmt = fmt_cls(request_id, self.backend.model_name, include_usage=body.include_usage)
        if isinstance(fmt, ChatFormat) and isinstance(body, ChatCompletionRequest):
            fmt.tools = body.tool_set  # answers parsed for tool calls (``tools``)
        choices: list[_Choice] = []
        try:
            for i, (ids, max_tokens) in enumerate(zip(prompts, budgets)):
                choice_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                choices.append(await self._start(request, endpoint, body, choice_id, ids, max_tokens))
        except BaseException as exc:
            await self._abandon(choices, exc)
            if not isinstance(exc, Exception):
                raise
            raise as_api_error(exc, request_id) from exc
        if body.stream:
            return await self._stream(request, choices, fmt)
        return await self._complete(request, choices, fmt)

    async def _start(
        self,
        request: Request,
        endpoint: str,
        body: CompletionRequest | ChatCompletionRequest,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
    ) -> _Choice:
        key = key_name(request.scope)
        admission = await self.limiter.admit(key, len(prompt_ids)) if self.limiter is not None else None
        try:
            events = self.backend.generate(
                request_id,
                prompt_ids,
                body.sampling_spec(max_tokens),
                session_id=request.headers.get(SESSION_HEADER),
            )
        except BaseException:
            if admission is not None:
                admission.release()
            raise
        tracker = RequestTracker(
            self.metrics, endpoint, request_id, len(prompt_ids), key=key, admission=admission, request=body, max_tokens=max_tokens
        )
        return _Choice(events, tracker)

    @staticmethod
    async def _abandon(choices: list[_Choice], exc: BaseException) -> None:
        """Cancel the choices already started when a later one could not be."""
        for choice in choices:
            await aclose(choice.events)
            _failed(choice.tracker, exc)

    async def _complete(self, request: Request, choices: list[_Choice], fmt: CompletionFormat | ChatFormat) -> Response:
        collect = [functools.partial(self._collect, c.events, c.tracker) for c in choices]
        try:
            texts = await unless_disconnected(request, _all_or_none(collect), self.shutdown)
        except BaseException as exc:
            for choice in choices:  # one cancelled before it began never closed its iterator
                await aclose(choice.events)
            errors = [_failed(choice.tracker, exc) for choice in choices]
            if errors[0] is None:
                raise
            raise errors[0] from exc
        for choice in choices:
            choice.tracker.finish(200)
        self.metrics.count(choices[0].tracker.endpoint, 200)
        usage = Usage.total([choice.tracker.usage() for choice in choices])
        results = [(text, choice.tracker.finish_reason) for text, choice in zip(texts, choices)]
        return JSONResponse(fmt.response_choices(results, usage))

    @staticmethod
    async def _collect(events: AsyncIterator[TokenEvent], tracker: RequestTracker) -> str:
        texts: list[str] = []
        try:
            while True:
                event = check_event(await anext(events, None))
                tracker.on_event(event)
                texts.append(event.text)
                if event.finished:
                    return "".join(texts)
        finally:
            await aclose(events)

    async def _stream(self, request: Request, choices: list[_Choice], fmt: CompletionFormat | ChatFormat) -> Response:
        """Wait for every choice's first event (a failure before it is a plain HTTP error), then stream."""

        async def first(choice: _Choice) -> TokenEvent:
            return check_event(await anext(choice.events, None))

        try:
            firsts = await unless_disconnected(
                request, _all_or_none([functools.partial(first, c) for c in choices]), self.shutdown
            )
        except BaseException as exc:
            await self._abandon(choices, exc)
            error = _failed(choices[0].tracker, exc)
            if error is None:
                raise
            raise error from exc
        streamed = [StreamedChoice(c.events, event, c.tracker) for c, event in zip(choices, firsts)]
        return EventStreamResponse(EventStream(streamed, fmt, self.shutdown))
