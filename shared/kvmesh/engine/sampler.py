"""Next-token choice per request: greedy, or temperature / top-k / top-p with a seed."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.engine.request import Request


def _sample_row(logits: torch.Tensor, req: Request) -> int:
    params = req.sampling
    scores = logits / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the tokens above it already reach top_p; the first always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=req.generator).item())


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """One token per row of ``logits`` (N, vocab), float32, for the matching request."""
    chosen = torch.argmax(logits, dim=-1).tolist()
    for row, req in enumerate(requests):
        if not req.sampling.greedy:
            chosen[row] = _sample_row(logits[row], req)
    return chosen
