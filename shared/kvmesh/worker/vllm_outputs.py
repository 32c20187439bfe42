"""What a vLLM worker passes to vLLM for logprobs and structured output, and how vLLM's
answers become kvmesh's, free of vLLM (``VllmCore`` calls these; unit tests need no model).

**Logprobs.** vLLM v1 returns, per token, a dict ``{token id: Logprob(logprob, rank, ...)}``
holding the sampled (or prompt) token first, then the top ``k`` in rank order
(``vllm.logprobs.append_logprobs_for_next_position``): ``k + 1`` entries, or ``k`` when the
token is among the top ``k`` (its entry then carries its top-``k`` position as its rank). Its
default ``logprobs_mode`` is ``raw_logprobs``, ``log_softmax`` in float32 of the logits the
sampler is given, before penalties, bias, temperature, min-p, top-k or top-p: the
distribution kvmesh's engine reports (``kvmesh.engine.logprobs``). One difference: vLLM
applies a structured-output request's grammar mask before its sampler, so a guided request's
logprobs are of the masked distribution (kvmesh's engine: of the unmasked one). ``-inf``
becomes ``LOGPROB_FLOOR``, as kvmesh's engine and vLLM's OpenAI server report it.

**Structured output** (``structured_outputs``): vLLM's ``guidance`` backend is llguidance,
the library kvmesh's engine uses, so a request gets the same grammar on either engine (a
request retried from one engine onto the other goes on under the grammar it started with).
JSON schemas carry kvmesh's JSON options (``x-guidance``: no free whitespace, ``", "`` and
``": "``), which llguidance reads from the schema itself.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvmesh.engine.logprobs import LOGPROB_FLOOR
from kvmesh.engine.request import TokenLogprob
from kvmesh.engine.structured import JSON_OPTIONS, GrammarError, GuidedDecoding, json_schema_of

__all__ = ["FORCED", "GUIDANCE", "logprobs_of", "prompt_logprobs_of", "structured_outputs_kwargs", "token_logprob"]

FORCED = "kvmesh_forced"  # SamplingParams.extra_args key: the tokens vLLM must output first (vllm_forced)
GUIDANCE = "guidance"  # vLLM's structured-output backend for kvmesh's workers (llguidance)


def _value(x: float) -> float:
    return float(x) if x > LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf and NaN too (NaN > x is False)


def token_logprob(entry: Mapping[int, Any], token_id: int, k: int) -> TokenLogprob:
    """kvmesh's ``TokenLogprob`` of ``token_id`` from vLLM's dict for its position, with the
    top ``k`` (id, logprob) most likely first."""
    items = list(entry.items())
    if token_id not in entry:
        raise ValueError(f"vLLM's logprobs do not hold the token {token_id}")
    if len(items) > k:  # the token first, outside the top k; then the top k in order
        tops = [(t, v) for t, v in items if t != token_id]
    else:  # the token is among the top k: its entry's rank is its place
        tops = sorted(items, key=lambda item: item[1].rank if item[1].rank is not None else math.inf)
    return TokenLogprob(int(token_id), _value(entry[token_id].logprob), tuple((int(t), _value(v.logprob)) for t, v in tops[:k]))


def logprobs_of(entries: Sequence[Mapping[int, Any]] | None, token_ids: Sequence[int], k: int) -> list[TokenLogprob | None]:
    """One ``TokenLogprob`` per sampled token (vLLM's list for these tokens)."""
    entries = list(entries or [])
    if len(entries) != len(token_ids):
        raise ValueError(f"vLLM gave {len(entries)} logprobs for {len(token_ids)} tokens")
    return [token_logprob(entry, token, k) for entry, token in zip(entries, token_ids)]


def prompt_logprobs_of(
    entries: Sequence[Mapping[int, Any] | None], prompt_token_ids: Sequence[int], k: int
) -> list[TokenLogprob | None]:
    """Every prompt token's ``TokenLogprob``, the first None (nothing comes before it)."""
    if len(entries) != len(prompt_token_ids):
        raise ValueError(f"vLLM gave {len(entries)} prompt logprobs for {len(prompt_token_ids)} prompt tokens")
    return [
        None if entry is None or i == 0 else token_logprob(entry, token, k)
        for i, (entry, token) in enumerate(zip(entries, prompt_token_ids))
    ]


def _with_json_options(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with kvmesh's JSON options under ``x-guidance`` (the schema's own win, as
    with kvmesh's engine, where they are llguidance's defaults)."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**JSON_OPTIONS, **(own if isinstance(own, dict) else {})}}


def structured_outputs_kwargs(spec: GuidedDecoding) -> dict[str, Any]:
    """The arguments of vLLM's ``StructuredOutputsParams`` for ``spec`` (guidance backend)."""
    if spec.kind == "json_object":
        return {"json": _with_json_options({"type": "object"})}
    if spec.kind == "json_schema":
        return {"json": _with_json_options(json_schema_of(spec))}
    if spec.kind == "regex":
        return {"regex": spec.value}
    try:
        choices = json.loads(spec.value)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"the choices are not a JSON list: {exc}") from exc
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("the choices must be a non-empty list of non-empty strings")
    return {"choice": choices}
