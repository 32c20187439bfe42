"""What changes a request's logits before its token is chosen: logit bias, min_tokens, penalties.

In vLLM v1's order (``vllm/v1/sample/sampler.py``): the bias is added, EOS and the stop token
ids are masked while fewer than ``min_tokens`` tokens were generated, then the penalties
(``vllm/model_executor/layers/utils.py::apply_penalties``): the repetition penalty divides a
positive logit (multiplies a negative one) of every token in the prompt or the output, as
transformers' ``RepetitionPenaltyLogitsProcessor`` does; then OpenAI's
``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over the generated
tokens only. All of it runs batched over the rows of the requests that use any of it; the others
are not touched, and a batch where none does is returned as it is. ``min_p`` comes later, after
the temperature (``kvmesh.engine.sampler``).
"""

from __future__ import annotations

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
    rows: list[int] = []
    tokens: list[int] = []
    for row, req in enumerate(reqs):
        params = req.sampling
        if req.num_output_tokens >= params.min_tokens:
            continue
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(req.eos_token_ids)
        rows.extend([row] * len(stops))
        tokens.extend(stops)
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(tokens, device=device)] = float("-inf")


def _penalize(logits: torch.Tensor, reqs: list[Request]) -> None:
    vocab = logits.shape[-1]
    device = logits.device
    repeat = [row for row, req in enumerate(reqs) if req.sampling.repetition_penalty != 1.0]
    if repeat:
        seen = _token_counts([reqs[row].token_ids for row in repeat], vocab, device) > 0
        penalty = torch.tensor([reqs[row].sampling.repetition_penalty for row in repeat], device=device).unsqueeze(1)
        index = torch.tensor(repeat, device=device)
        sub = logits.index_select(0, index)
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits.index_copy_(0, index, torch.where(seen, penalized, sub))
    additive = [
        row for row, req in enumerate(reqs) if req.sampling.presence_penalty or req.sampling.frequency_penalty
    ]
    if additive:
        counts = _token_counts([reqs[row].output_token_ids for row in additive], vocab, device)
        frequency = torch.tensor([reqs[row].sampling.frequency_penalty for row in additive], device=device)
        presence = torch.tensor([reqs[row].sampling.presence_penalty for row in additive], device=device)
        index = torch.tensor(additive, device=device)
        delta = frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0)
        logits.index_copy_(0, index, logits.index_select(0, index) - delta)


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(len(token_lists), vocab) float32: how often each token occurs in each list."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        padded = [tokens + [vocab] * (width - len(tokens)) for tokens in token_lists]  # vocab: a spare column
        ids = torch.tensor(padded, device=device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]
