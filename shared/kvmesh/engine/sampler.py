"""Next-token choice per request: greedy, or temperature / top-k / top-p with a seed.

Degenerate values follow vLLM (``vllm/sampling_params.py`` and ``vllm/v1/sample/``): a
temperature below ``SAMPLING_EPS`` is greedy (``SamplingParams.greedy``); one below
``MIN_TEMPERATURE`` is raised to it (vLLM's ``_MAX_TEMP``), as dividing by it overflows
float32; top-p drops a token once the tokens above it reach top_p (the rule of vLLM's
``apply_top_k_top_p``, there on an ascending sort) but always keeps the most likely one
(vLLM's ``top_p_mask[:, -1] = False``), so a top-p that is 0.0 in float32 means the
argmax. Beyond vLLM, a row whose probabilities still come out non-finite or all zero takes
the argmax instead of raising. Penalties, logit bias and min_tokens change the logits first, for
greedy and sampled rows alike (``kvmesh.engine.logits_processors``); ``min_p`` drops, after the
temperature, the tokens less likely than ``min_p`` times the most likely one (vLLM's order, and
transformers' ``MinPLogitsWarper``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvmesh.engine.logits_processors import process_logits
from kvmesh.engine.request import Request
from kvmesh.engine.structured import apply_grammar_masks

logger = logging.getLogger(__name__)

MIN_TEMPERATURE = 1e-2


def filtered_scores(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """One row's scores to sample from: temperature, then min-p, top-k and top-p masks."""
    params = req.sampling
    scores = logits / max(params.temperature, MIN_TEMPERATURE)
    if params.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the tokens above it already reach top_p; the first always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[0] = False
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    return scores


def _sample_row(logits: torch.Tensor, req: Request) -> int:
    probs = torch.softmax(filtered_scores(logits, req), dim=-1)
    if not bool(torch.isfinite(probs).all() & (probs.sum() > 0)):
        logger.warning("request %s: no valid distribution to sample; taking the argmax", req.request_id)
        return int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"))).item())
    if req.generator is not None:
        # A seeded request draws on the CPU, where its generator is, whatever the device: a
        # CUDA tensor refuses a CPU generator, and the same seed draws alike on every device.
        probs = probs.to(req.generator.device)
    return int(torch.multinomial(probs, 1, generator=req.generator).item())


def _processed(logits: torch.Tensor, requests: Sequence[Request]) -> tuple[torch.Tensor, dict[int, Exception]]:
    """The processed logits, batched; should that raise, row by row, and the rows that raise
    are failed alone."""
    try:
        return process_logits(logits, requests), {}
    except Exception:  # noqa: BLE001 - find the request at fault
        rows = list(logits)
        failed: dict[int, Exception] = {}
        for row, req in enumerate(requests):
            try:
                rows[row] = process_logits(logits[row : row + 1], [req])[0]
            except Exception as exc:  # noqa: BLE001
                failed[row] = exc
        return torch.stack(rows), failed


def sample_rows(logits: torch.Tensor, requests: Sequence[Request]) -> list[int | Exception]:
    """One token per row of ``logits`` (N, vocab), float32, for the matching request; a row
    whose sampling raised gives that exception instead, and the other rows are unaffected."""
    logits, failed = _processed(logits, requests)
    logits, grammar_failed = apply_grammar_masks(logits, requests)  # structured output
    failed.update(grammar_failed)
    # max's indices are argmax's (the first maximum; NaN counts as the maximum), and on CPU
    # 2.6x faster for a (32, 49152) batch: 0.41 vs 1.08 ms (benchmarks/argmax_bench.py).
    chosen: list[int | Exception] = list(torch.max(logits, dim=-1).indices.tolist())
    for row, req in enumerate(requests):
        if row in failed:
            chosen[row] = failed[row]
            continue
        if req.sampling.greedy:
            continue
        try:
            chosen[row] = _sample_row(logits[row], req)
        except Exception as exc:  # noqa: BLE001 - the engine fails this request only
            chosen[row] = exc
    return chosen


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """Like ``sample_rows``, but the first failed row raises."""
    chosen = sample_rows(logits, requests)
    for value in chosen:
        if isinstance(value, Exception):
            raise value
    return chosen  # type: ignore[return-value]
