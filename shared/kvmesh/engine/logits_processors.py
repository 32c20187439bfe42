"""What changes a request's logits before its token is chosen: logit bias, min_tokens, penalties.

In vLLM v1's order (``vllm/v1/sample/sampler.py``): the bias is added, EOS and the stop token
ids are masked while fewer than ``min_tokens`` tokens were generated, then the penalties
(``vllm/model_executor/layers/utils.py::apply_penalties``): the repetition penalty divides a
positive logit (multiplies a negative one) of every token in the prompt or the output, as
transformers' ``RepetitionPenaltyLogitsProcessor`` does; then OpenAI's
``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over the generated
tokens only (those an earlier attempt of a resumed request generated too). All of it runs batched over the rows of the requests that use any of it; the others
are not touched, and a batch where none does is returned as it is. ``min_p`` comes later, after
the temperature (``kvmesh.engine.sampler``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kvmesh.engine.request import Request

__all__ = ["process_logits"]


def process_logits(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """``logits`` (N, vocab) with each row's request's processing applied: the same tensor
    when no request asks for any, else a new one."""
    rows = [row for row, req in enumerate(requests) if req.sampling.processes_logits]
    if not rows:
        return logits
    reqs = [requests[row] for row in rows]
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index)
    _add_bias(sub, reqs)
    _mask_early_stops(sub, reqs)
    _penalize(sub, reqs)
    out = logits.clone()
    out.index_copy_(0, index, sub)
    return out


def _add_bias(logits: torch.Tensor, reqs: list[Request]) -> None:
    rows: list[int] = []
    tokens: list[int] = []
    biases: list[float] = []
    for row, req in enumerate(reqs):
        for token, bias in req.sampling.logit_bias.items():
            rows.append(row)
            tokens.append(token)
            biases.append(bias)
    if rows:
        device = logits.device
        values = torch.tensor(biases, dtype=logits.dtype, device=device)
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)), values, accumulate=True)


def _mask_early_stops(logits: torch.Tensor, reqs: list[Request]) -> None:
    vocab = logits.shape[-1]
    rows: list[int] = []
    tokens: list[int] = []
    for row, req in enumerate(reqs):
        params = req.sampling
        if req.num_generated_tokens >= params.min_tokens:
            continue
        stops = {t for t in params.stop_token_ids if t < vocab}  # one past the vocabulary never comes
        if not params.ignore_eos:
            stops.update(req.eos_token_ids)
        rows.extend([row] * len(stops))
        tokens.extend(stops)
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(tokens, device=device)] = float("-inf")


def _penalize(logits: torch.Tensor, reqs: list[Request]) -> None:
    """The penalties, computed only at the tokens that occurred (as transformers gathers and
    scatters them): a token that occurs twice is written twice with the same value."""
    device = logits.device
    repeat = [row for row, req in enumerate(reqs) if req.sampling.repetition_penalty != 1.0]
    if repeat:
        rows, ids, lengths = _occurrences(repeat, [reqs[row].token_ids for row in repeat], device)
        penalty = torch.tensor([reqs[row].sampling.repetition_penalty for row in repeat], device=device)
        penalty = penalty.repeat_interleave(lengths)
        values = logits[rows, ids]
        logits[rows, ids] = torch.where(values > 0, values / penalty, values * penalty)
    additive = [
        row for row, req in enumerate(reqs) if req.sampling.presence_penalty or req.sampling.frequency_penalty
    ]
    if additive:
        rows, ids, lengths = _occurrences(additive, [reqs[row].generated_token_ids for row in additive], device)
        if ids.numel():
            counts = torch.zeros(logits.shape, device=device)
            counts.index_put_((rows, ids), torch.ones(ids.shape, device=device), accumulate=True)
            frequency = torch.tensor([reqs[row].sampling.frequency_penalty for row in additive], device=device)
            presence = torch.tensor([reqs[row].sampling.presence_penalty for row in additive], device=device)
            delta = frequency.repeat_interleave(lengths) * counts[rows, ids] + presence.repeat_interleave(lengths)
            logits[rows, ids] = logits[rows, ids] - delta


def _occurrences(
    rows: list[int], token_lists: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token of each list with its row, flat; and each list's length."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    return torch.tensor(rows, device=device).repeat_interleave(lengths), ids, lengths
