"""How many free KV blocks admission keeps back for the running requests' next tokens.

Admitting a waiting request whenever its prompt fits fills the pool with prompts; as the
running requests then grow, the pool runs dry and the scheduler preempts one, whose tokens are
computed again when it comes back. Under load that recomputation is work thrown away: with
32 requests of 128 + 128 tokens in a pool of about 5,800 tokens, 21 preemptions made a run
take 387 steps instead of 260 (``benchmarks/engine_serving_load.py``).

So a waiting request is admitted only where the pool holds, at every step ahead, what it and
the running requests are expected to fill by then. Each is expected to make ``ratio`` of its
remaining token allowance (``max_tokens`` left, at most ``CLIP_TOKENS`` and never past the
model's length), one token a step, and to give its blocks back when it is done. The peak of
that demand comes just before one of them finishes; the blocks that earlier finishers give back
count for those still growing, so requests at different stages share the pool (a rule that
kept every request's whole remaining length apart would admit about 22 such requests where 30
fit). With nothing running, the first request that fits is admitted whatever it may need; a
stream resumed from a worker that died (its client mid-answer) is admitted wherever it fits now.

A decode worker's requests arrive with their prompt's KV, pulled from a prefill worker into
blocks taken before the pull (``LLMEngine.allocate_import``). Those blocks are taken by the
same rule, after the requests already waiting, and the growth of imports still being pulled
counts with the running requests': with 32 requests of 128 + 128 tokens on a decode worker of
256 MiB, taking blocks whenever each running request had one free block to grow into
preempted 20-23 requests a round (``docs/benchmarks.md``).

``ratio`` is learned. It is the larger of two figures: the share of its allowance each
finished request used (the mean over the last ``HISTORY``, ``INITIAL_USAGE`` before any
finished), and a boost that a preemption sets to 1 (the estimate was too low) and that decays
to nothing over ``BOOST_STEPS`` steps. Requests that run to ``max_tokens`` are expected to run
to it; requests that stop early at an end token are expected to make their usual length.
(SGLang's ``new_token_ratio`` reserves by the same idea, with a ratio that decays on a fixed
schedule.)
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


@dataclass(slots=True, frozen=True)
class Growth:
    """A request's expected growth: ``remaining`` more tokens from ``tokens`` now, in a
    pool where it holds ``held`` blocks."""

    remaining: int
    tokens: int
    held: int


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
        return self.allowance_of(req.num_tokens, req.sampling.max_tokens - req.num_output_tokens)

    def allowance_of(self, num_tokens: int, max_tokens_left: int) -> int:
        """Tokens a request of ``num_tokens`` with ``max_tokens_left`` may still generate."""
        return max(0, min(max_tokens_left, CLIP_TOKENS, self.max_model_len - num_tokens))

    def growth(self, req: Request, num_held_blocks: int, ratio: float) -> Growth:
        """What ``req`` (holding ``num_held_blocks``) is expected to still make."""
        return self.expected(self.allowance(req), req.num_tokens, num_held_blocks, ratio)

    def expected(self, allowance: int, num_tokens: int, num_held_blocks: int, ratio: float) -> Growth:
        """What a request of ``num_tokens`` (holding ``num_held_blocks``) with ``allowance``
        tokens left is expected to still make."""
        return Growth(int(ratio * allowance + 0.999), num_tokens, num_held_blocks)

    def peak_blocks(self, growths: list[Growth]) -> int:
        """The most blocks beyond those they hold that ``growths`` are expected to need at
        once, at any step ahead, counting the blocks each gives back when it is done: the
        demand just before each finish, the largest of them (0 if they fit in their own)."""
        peak = 0
        held = sum(g.held for g in growths)
        for t in {g.remaining for g in growths}:
            running = sum(cdiv(g.tokens + t, self.block_size) for g in growths if g.remaining >= t)
            peak = max(peak, running - held)
        return peak

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


__all__ = ["BOOST_STEPS", "CLIP_TOKENS", "Growth", "GrowthReserve", "HISTORY", "INITIAL_USAGE"]
