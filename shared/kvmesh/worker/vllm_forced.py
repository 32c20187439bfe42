"""A vLLM logits processor (``logits_processors`` in the engine args) that makes a request's
first outputs the tokens named in ``SamplingParams.extra_args["kvmesh_forced"]``: every other
token's logit is ``-inf`` while the request has output fewer of them.

What it is for: structured output on a vLLM worker that continues a request somebody else
began. vLLM starts a request's grammar at its first output token and cannot be given a state,
so a decode worker that imports a prefill's KV (the first token sampled there, under the same
grammar) gives vLLM the prompt alone and has it output that first token again, forced, under
its grammar; a resumed request's earlier tokens are forced the same way. ``VllmCore`` drops
the forced tokens from the outputs (and fails the request should vLLM output another).

The grammar's mask comes first (vLLM applies it before its sampler): a forced token the
grammar does not allow is left at ``-inf`` and so is every other, vLLM outputs some other
token, and ``VllmCore`` fails the request by name. Imported only by vLLM, in a worker.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor  # type: ignore[import-not-found]
from vllm.v1.sample.logits_processor.builtin import process_dict_updates  # type: ignore[import-not-found]

from kvmesh.worker.vllm_outputs import FORCED


class ForcedTokens(LogitsProcessor):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[
            int, tuple[list[int], list[int]]
        ] = {}  # batch row -> (forced tokens, its output tokens: vLLM's live list)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        forced = (sampling_params.extra_args or {}).get(FORCED)
        if forced is not None and not (isinstance(forced, list) and all(isinstance(t, int) and t >= 0 for t in forced)):
            raise ValueError(f"extra_args[{FORCED!r}] must be a list of token ids")

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token

    @staticmethod
    def _new(params: Any, _prompt: list[int] | None, output: list[int]) -> tuple[list[int], list[int]] | None:
        forced = (params.extra_args or {}).get(FORCED)
        return (list(forced), output) if forced and len(output) < len(forced) else None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new)
        for row in [row for row, (forced, output) in self.rows.items() if len(output) >= len(forced)]:
            del self.rows[row]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (forced, output) in self.rows.items():
            token = forced[len(output)]
            kept = logits[row, token].clone()
            logits[row] = float("-inf")
            logits[row, token] = kept
        return logits
