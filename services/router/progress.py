"""One request as its client sees it, across attempts: the tokens sent so far, their text,
and whether a token has ended it.

The router detokenizes itself, so the text stays one stream whether the first token came
from the prefill worker, the rest from a decode worker, and a retry resumed on others.
"""

from __future__ import annotations

from kvmesh.engine.detokenizer import OutputText
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.protocol import LogprobSpec, SamplingSpec, TokenEvent


class RequestProgress:
    def __init__(
        self,
        request_id: str,
        tokenizer: Tokenizer,
        sampling: SamplingSpec,
        eos_token_ids: tuple[int, ...],
        num_prompt_tokens: int,
    ) -> None:
        self.request_id = request_id
        self.sampling = sampling
        self.eos_token_ids = () if sampling.ignore_eos else eos_token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.emitted: list[int] = []
        self.finish_reason: str | None = None
        self._text = OutputText(tokenizer, tuple(sampling.stop), sampling.min_tokens)
        self._seq = 0
        self.prompt_logprobs: list[LogprobSpec | None] | None = None  # until the first event takes them
        self.prompt_logprobs_sent = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_tokens - len(self.emitted)

    def attempt_sampling(self) -> SamplingSpec:
        """The sampling of the next attempt, whose prompt ends with the tokens already sent:
        the rest of the budget, and those tokens counted as generated (penalties, min_tokens)."""
        update: dict = {"max_tokens": self.remaining_tokens, "prior_output_tokens": len(self.emitted)}
        if self.emitted or self.prompt_logprobs_sent:  # the prompt's logprobs are sent once, with the first event
            update["prompt_logprobs"] = None
        return self.sampling.model_copy(update=update)

    def add(
        self,
        token_ids: list[int],
        worker_finish_reason: str | None = None,
        logprobs: list[LogprobSpec | None] | None = None,
    ) -> TokenEvent | None:
        """Take new tokens (and their logprobs, one each, when asked for); returns the event
        for the client (None if nothing to say)."""
        if self.finished:
            return None
        accepted: list[int] = []
        for token in token_ids:
            accepted.append(token)
            self.emitted.append(token)
            if self._text.add_token(token) or token in self.eos_token_ids or token in self.sampling.stop_token_ids:
                self.finish_reason = "stop"
            elif self.remaining_tokens <= 0:
                self.finish_reason = "length"
            if self.finished:
                break
        if not self.finished and worker_finish_reason is not None:
            self.finish_reason = worker_finish_reason  # e.g. the context is full
        if not accepted and not self.finished:
            return None
        event = TokenEvent(
            request_id=self.request_id,
            seq=self._seq,
            token_ids=accepted,
            text=self._text.take_delta(self.finished),
            finished=self.finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            logprobs=self._logprobs(accepted, logprobs),
            prompt_logprobs=None if self.prompt_logprobs_sent else self.prompt_logprobs,
        )
        self.prompt_logprobs_sent = self.prompt_logprobs_sent or self.prompt_logprobs is not None
        self._seq += 1
        return event

    def _logprobs(self, accepted: list[int], logprobs: list[LogprobSpec | None] | None) -> list[LogprobSpec | None] | None:
        if self.sampling.logprobs is None:
            return None
        given = list(logprobs or [])[: len(accepted)]
        return given + [None] * (len(accepted) - len(given))  # a worker that sent none (never kvmesh's)
