"""Log-probabilities of sampled tokens and of prompt tokens, for ``logprobs`` / ``echo``.

Of which distribution: the model's raw next-token distribution, ``log_softmax`` of the
logits in float32 before logit bias, penalties, min_tokens, temperature, min-p, top-k or
top-p. That is vLLM v1's default (``logprobs_mode="raw_logprobs"``: "the values before
applying logit processors"; its sampler computes them from the logits it is given, before
anything else), so a greedy token's logprob is the same at any temperature, and a token a
processor masked still has a finite logprob. A ``-inf`` (a model that outputs one) is
reported as ``LOGPROB_FLOOR``, as vLLM's OpenAI server does, so it crosses JSON.

Prompt logprobs need the logits of every prompt position, so a request that asks for them
does not reuse cached prompt blocks (``KVCacheManager.get_computed_blocks``, as vLLM v1
skips the prefix cache for it); KV pulled from a peer is not used by it either, and a
decode worker never computes them: they come from whoever prefilled the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.engine.request import Request, TokenLogprob

__all__ = ["LOGPROB_FLOOR", "PromptSpan", "logprob_rows", "record_prompt_logprobs", "record_sample_logprobs"]

LOGPROB_FLOOR = -9999.0
_CHUNK_ROWS = 256  # prompt positions whose full-vocabulary logprobs are held at once


def _value(x: float) -> float:
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf and NaN too


def logprob_rows(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """Each row's ``token_ids[row]`` logprob and top ``k``, from raw ``logits`` (N, vocab)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, dtype=torch.long, device=logits.device).unsqueeze(1))
    chosen_values = chosen.squeeze(1).tolist()
    if k:
        top = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out = []
    for row, token in enumerate(token_ids):
        tops = tuple(zip(top_ids[row], map(_value, top_values[row]))) if k else ()
        out.append(TokenLogprob(int(token), _value(chosen_values[row]), tops))
    return out


def record_sample_logprobs(logits: torch.Tensor, requests: Sequence[Request], chosen: Sequence[int | Exception]) -> None:
    """Append the logprob of each row's sampled token to its request, for those that ask."""
    rows = [
        row for row, req in enumerate(requests) if req.sampling.logprobs is not None and not isinstance(chosen[row], Exception)
    ]
    if not rows:
        return
    k = max(requests[row].sampling.logprobs or 0 for row in rows)
    index = torch.tensor(rows, device=logits.device)
    results = logprob_rows(logits.index_select(0, index), [int(chosen[row]) for row in rows], k)  # type: ignore[arg-type]
    for row, result in zip(rows, results):
        req = requests[row]
        wanted = req.sampling.logprobs or 0
        req.logprobs.append(TokenLogprob(result.token_id, result.logprob, result.top[:wanted]))


class PromptSpan:
    """The prompt positions of one prefill chunk whose logits a request's prompt logprobs need:
    the chunk's rows ``flat_start + i`` are positions ``start_pos + i``."""

    __slots__ = ("request", "flat_start", "start_pos", "count")

    def __init__(self, request: Request, flat_start: int, start_pos: int, count: int) -> None:
        self.request, self.flat_start, self.start_pos, self.count = request, flat_start, start_pos, count

    def wanted(self) -> range:
        """The positions (absolute) whose next token is a prompt token not yet recorded."""
        req = self.request
        first = max(self.start_pos, len(req.prompt_logprobs) - 1)  # a recomputed chunk (preemption) is not recorded twice
        last = min(self.start_pos + self.count, req.num_prompt_tokens - 1)
        return range(first, last)


def record_prompt_logprobs(hidden: torch.Tensor, spans: Sequence[PromptSpan], logits_of) -> None:
    """Append each span's prompt logprobs to its request: the logprob at position ``p`` is the
    prompt token ``p + 1``'s, from the logits at ``p`` (``logits_of(hidden rows)``), in chunks."""
    for span in spans:
        req = span.request
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)  # the first prompt token has no logprob
        positions = span.wanted()
        k = req.sampling.prompt_logprobs or 0
        for start in range(positions.start, positions.stop, _CHUNK_ROWS):
            chunk = range(start, min(start + _CHUNK_ROWS, positions.stop))
            rows = torch.arange(chunk.start, chunk.stop, device=hidden.device) - span.start_pos + span.flat_start
            logits = logits_of(hidden.index_select(0, rows))
            req.prompt_logprobs.extend(logprob_rows(logits, req.token_ids[chunk.start + 1 : chunk.stop + 1], k))
