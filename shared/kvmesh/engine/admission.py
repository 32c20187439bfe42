"""How many free KV blocks admission keeps back for the running requests' next tokens.

Admitting a waiting request whenever its prompt fits fills the pool with prompts; as the
running requests then grow, the pool runs dry and the scheduler preempts one, whose tokens are
computed again when it comes back. Under load that recomputation is work thrown away: with
32 requests of 128 + 128 tokens in a pool of about 5,800 tokens, 21 preemptions made a run
take 387 steps instead of 260 (``benchmarks/engine_serving_load.py``).

So a waiting request is admitted only while the blocks left after it cover what the running
requests, and it, are expected to still need: for each, ``ratio`` times its remaining token
allowance (``max_tokens`` left, at most ``CLIP_TOKENS`` and never past the model's length),
as blocks beyond those it holds. With nothing running, the first request that fits is
admitted whatever it may need later.

``ratio`` is learned. It is the larger of two figures: the share of its allowance each
finished request used (the mean over the last ``HISTORY``, ``INITIAL_USAGE`` before any
finished), and a boost that a preemption sets to 1 (the estimate was too low) and that decays
to nothing over ``BOOST_STEPS`` steps. Requests that run to ``max_tokens`` make the reserve
their whole length; requests that stop early at an end token make it their usual length, and
admission is almost as eager as without a reserve. (SGLang's ``new_token_ratio`` reserves by
the same idea, with a ratio that decays on a fixed schedule.)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvmesh.engine.kv_cache_manager import cdiv
from kvmesh.engine.request import FinishReason, Request

CLIP_TOKENS = 4096  # an allowance counts for at most this many tokens (a default max_tokens can be the whole context)
HISTORY = 64  # finished requests whose usage makes the estimate
INITIAL_USAGE = 0.7  # before any request finished
BOOST_STEPS = 300  # steps over which a preemption's boost decays


@dataclass(slots=True)
class GrowthReserve:
    """The expected growth of requests, in tokens and blocks (see the module's text)."""

    max_model_len: int
    block_size: int
    usages: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    boost: float = 0.0

    @property
    def ratio(self) -> float:
        usage = sum(self.usages) / len(self.usages) if self.usages else INITIAL_USAGE
        return max(usage, self.boost)

    def allowance(self, req: Request) -> int:
        """Tokens ``req`` may still generate, as the reserve counts them."""
        if req.export_kv:
            return 0  # a prefill for export makes its first token and stops
        left = req.sampling.max_tokens - req.num_output_tokens
        return max(0, min(left, CLIP_TOKENS, self.max_model_len - req.num_tokens))

    def blocks_needed(self, req: Request, num_held_blocks: int, ratio: float) -> int:
        """Blocks beyond ``num_held_blocks`` that ``req`` is expected to fill: the rest of its
        prompt and ``ratio`` of its allowance."""
        expected = req.num_tokens + int(ratio * self.allowance(req) + 0.999)
        return max(0, cdiv(expected, self.block_size) - num_held_blocks)

    def stepped(self) -> None:
        self.boost = max(0.0, self.boost - 1.0 / BOOST_STEPS)

    def preempted(self) -> None:
        self.boost = 1.0

    def finished(self, req: Request) -> None:
        """Learn from ``req``'s end how much of its allowance a request uses (an abort or an
        error says nothing of that; nor does a prefill for export)."""
        if req.export_kv or req.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        allowance = min(req.sampling.max_tokens, CLIP_TOKENS, self.max_model_len - req.num_prompt_tokens)
        if allowance > 0:
            self.usages.append(min(1.0, req.num_output_tokens / allowance))


__all__ = ["BOOST_STEPS", "CLIP_TOKENS", "GrowthReserve", "HISTORY", "INITIAL_USAGE"]
