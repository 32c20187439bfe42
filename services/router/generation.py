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
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvmesh.protocol import SamplingSpec, TokenEvent
from kvmesh.services.router.auth import key_name
from kvmesh.services.router.backend import GenerationBackend
from kvmesh.services.router.choices import (
    ChoiceLogprobs,
    PromptEcho,
    TokenText,
    after_leader,
    check_choices,
    check_prompt_logprobs,
    choice_sampling,
    leading,
    merge_logprobs,
)
from kvmesh.services.router.metrics import RequestTracker, RouterMetrics
from kvmesh.services.router.openai_api import (
    APIError,
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
    Usage,
)
from kvmesh.services.router.prompts import check_token_ids, check_min_tokens, resolve_max_tokens
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
    """One choice's request in the mesh."""

    events: AsyncIterator[TokenEvent]
    tracker: RequestTracker
    logprobs: ChoiceLogprobs | None = None
    echo: PromptEcho | None = None
    counts_prompt: bool = True  # the first choice of its prompt (``n``: usage counts a prompt once)

    def usage(self) -> Usage:
        usage = self.tracker.usage()
        return usage if self.counts_prompt else usage.completion_only()


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
    failure (in order) is raised. One work (one choice: most requests) is awaited as is, in
    the caller's task: there is nothing to cancel beside it, and a task of its own cost the
    first token a few turns of the event loop on each side."""
    if len(works) == 1:
        return [await works[0]()]
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
        vocab_size = self.backend.tokenizer.vocab_size
        check_token_ids(body.logit_bias, vocab_size, param="logit_bias")
        check_token_ids(body.stop_token_ids, vocab_size, param="stop_token_ids")
        check_prompt_logprobs(body.num_prompt_logprobs, prompts)
        check_choices(body.num_choices, len(prompts))
        request_id = uuid.uuid4().hex
        fmt_cls = CompletionFormat if endpoint == COMPLETIONS else ChatFormat
        fmt = fmt_cls(request_id, self.backend.model_name, include_usage=body.include_usage)
        if isinstance(fmt, ChatFormat) and isinstance(body, ChatCompletionRequest):
            fmt.tools = body.tool_set  # answers parsed for tool calls (``tools``)
        choices: list[_Choice] = []
        n = body.num_choices
        token_text = TokenText(self.backend.tokenizer) if body.num_logprobs is not None else None
        try:
            for i, (ids, max_tokens) in enumerate(zip(prompts, budgets)):
                spec = body.sampling_spec(max_tokens)
                echo = self._echo(body, i, ids)
                session = request.headers.get(SESSION_HEADER) or (f"n-{request_id}-{i}" if n > 1 else None)
                started = asyncio.Event()  # the prompt's first choice has its first token: its prompt is cached
                for j in range(n):
                    k = i * n + j
                    choice_id = request_id if len(prompts) * n == 1 else f"{request_id}-{k}"
                    sampling = choice_sampling(spec, j)
                    if j:
                        sampling = sampling.model_copy(update={"prompt_logprobs": None})  # the first's serve them all
                    choice = await self._start(request, endpoint, choice_id, ids, sampling, session, body, charge_prompt=j == 0)
                    if n > 1:
                        choice.events = leading(choice.events, started) if j == 0 else after_leader(choice.events, started)
                    choice.counts_prompt = j == 0
                    choice.echo = echo
                    if token_text is not None:
                        choice.logprobs = ChoiceLogprobs(token_text, chat=endpoint == CHAT_COMPLETIONS, top=body.num_logprobs or 0)
                    choices.append(choice)
        except BaseException as exc:
            await self._abandon(choices, exc)
            if not isinstance(exc, Exception):
                raise
            raise as_api_error(exc, request_id) from exc
        if body.stream:
            return await self._stream(request, choices, fmt)
        return await self._complete(request, choices, fmt)

    def _echo(self, body: CompletionRequest | ChatCompletionRequest, index: int, ids: list[int]) -> PromptEcho | None:
        """Completions' ``echo``: prompt ``index``'s text, and whether its logprobs are wanted."""
        if not isinstance(body, CompletionRequest) or not body.echo:
            return None
        prompt = body.prompts[index]
        text = prompt if isinstance(prompt, str) else self.backend.tokenizer.decode(ids, skip_special_tokens=False)
        return PromptEcho(text, list(ids), wants_logprobs=body.num_prompt_logprobs is not None)

    async def _start(
        self,
        request: Request,
        endpoint: str,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingSpec,
        session_id: str | None,
        body: CompletionRequest | ChatCompletionRequest,
        *,
        charge_prompt: bool = True,
    ) -> _Choice:
        """``charge_prompt``: False for a prompt's choices after its first (``n``), whose
        prompt is charged to the key's input tokens once, as usage counts it."""
        key = key_name(request.scope)
        prompt_tokens = len(prompt_ids) if charge_prompt else 0
        admission = await self.limiter.admit(key, prompt_tokens) if self.limiter is not None else None
        try:
            events = self.backend.generate(request_id, prompt_ids, sampling, session_id=session_id)
        except BaseException:
            if admission is not None:
                admission.release()
            raise
        tracker = RequestTracker(
            self.metrics, endpoint, request_id, len(prompt_ids), key=key, admission=admission, request=body, max_tokens=sampling.max_tokens
        )
        return _Choice(events, tracker)

    @staticmethod
    async def _abandon(choices: list[_Choice], exc: BaseException) -> None:
        """Cancel the choices already started when a later one could not be."""
        for choice in choices:
            await aclose(choice.events)
            _failed(choice.tracker, exc)

    async def _complete(self, request: Request, choices: list[_Choice], fmt: CompletionFormat | ChatFormat) -> Response:
        collect = [functools.partial(self._collect, c) for c in choices]
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
        usage = Usage.total([choice.usage() for choice in choices])
        results = []
        logprobs: list[dict[str, Any] | None] = []
        for (text, fragments), choice in zip(texts, choices):
            echo = choice.echo
            results.append(((echo.text if echo else "") + text, choice.tracker.finish_reason))
            if choice.logprobs is not None:
                prompt_part = echo.fragment(_fresh(choice.logprobs)) if echo else None
                if prompt_part is not None:  # offsets from the start of the prompt's text
                    fragments = _reoffset(prompt_part, fragments)
                logprobs.append(merge_logprobs(fragments) or choice.logprobs.fragment([], []))
        return JSONResponse(fmt.response_choices(results, usage, logprobs or None))

    @staticmethod
    async def _collect(choice: _Choice) -> tuple[str, list[dict[str, Any]]]:
        """A choice's text and its logprobs' fragments, event by event."""
        events, tracker = choice.events, choice.tracker
        texts: list[str] = []
        fragments: list[dict[str, Any]] = []
        try:
            while True:
                event = check_event(await anext(events, None))
                tracker.on_event(event)
                if choice.echo is not None:
                    choice.echo.take(event)
                texts.append(event.text)
                if choice.logprobs is not None and event.token_ids:
                    fragments.append(choice.logprobs.fragment(event.token_ids, event.logprobs))
                if event.finished:
                    return "".join(texts), fragments
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
        for choice, event in zip(choices, firsts):
            if choice.echo is not None:
                choice.echo.take(event)
        streamed = [
            StreamedChoice(c.events, event, c.tracker, c.logprobs, c.echo, c.counts_prompt) for c, event in zip(choices, firsts)
        ]
        return EventStreamResponse(EventStream(streamed, fmt, self.shutdown))


def _fresh(logprobs: ChoiceLogprobs) -> ChoiceLogprobs:
    """A formatter like ``logprobs`` whose offsets start at the text's beginning."""
    return ChoiceLogprobs(logprobs.text, chat=logprobs.chat, top=logprobs.top)


def _reoffset(prompt_part: dict[str, Any], fragments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompt's fragment, then the completion's with their text offsets moved past it."""
    shift = sum(len(token) for token in prompt_part.get("tokens", []))
    moved = [{**f, "text_offset": [o + shift for o in f["text_offset"]]} if "text_offset" in f else f for f in fragments]
    return [prompt_part, *moved]
