"""Replaying a Mooncake-format trace against a running mesh, scaled to what it can serve.

Each ``hash_id`` becomes a fixed block of token ids (equal ids give equal tokens, so equal
trace prefixes are equal prompt prefixes), blocks are shrunk to ``tokens_per_block`` tokens,
output lengths capped, arrivals scaled; requests are sent at their arrival times through the
OpenAI API and streamed. Reported: TTFT, throughput, and the prompt tokens the mesh served
from its KV cache against what an unbounded cache could have (the oracle).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import httpx

from kvmesh.replay.trace import TraceRequest

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class DriveConfig:
    base_url: str
    model: str
    tokens_per_block: int = 16  # each trace block (512 tokens) becomes this many tokens
    max_blocks: int = 32  # prompts are capped at this many blocks
    max_output_tokens: int = 16
    max_requests: int = 50
    time_scale: float = 1.0  # arrival gaps are multiplied by this (after the trace's own scaling)
    vocab_low: int = 100  # token ids are drawn from [vocab_low, vocab_high)
    vocab_high: int = 49000
    timeout: float = 300.0


@dataclass(slots=True)
class DriveResult:
    requests: int
    failed: int
    seconds: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    oracle_cached_tokens: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_mean_ms: float

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        values = asdict(self)
        values["output_tokens_per_s"] = self.throughput
        values["hit_rate"] = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        values["oracle_hit_rate"] = self.oracle_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return values


def block_tokens(hash_id: int, size: int, low: int, high: int) -> list[int]:
    rng = random.Random(hash_id * 2654435761 % 2**32)
    return [rng.randrange(low, high) for _ in range(size)]


def prompt_for(request: TraceRequest, config: DriveConfig) -> list[int]:
    tokens: list[int] = []
    for hash_id in request.hash_ids[: config.max_blocks]:
        tokens += block_tokens(hash_id, config.tokens_per_block, config.vocab_low, config.vocab_high)
    return tokens


def oracle_cached_tokens(requests: Sequence[TraceRequest], config: DriveConfig, engine_block: int = 16) -> int:
    """Prompt tokens an unbounded shared cache could serve, at the engine's block size and
    leaving each prompt's last token to compute, as the engine does."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for request in requests:
        ids = request.hash_ids[: config.max_blocks]
        prompt_len = len(ids) * config.tokens_per_block
        blocks_per_id = config.tokens_per_block // engine_block
        usable = (prompt_len - 1) // engine_block
        hits = 0
        for index in range(len(ids)):
            prefix = tuple(ids[: index + 1])
            if prefix in seen:
                hits = min(usable, (index + 1) * blocks_per_id)
            seen.add(prefix)
        total += hits * engine_block
    return total


async def _one(client: httpx.AsyncClient, config: DriveConfig, request: TraceRequest, delay: float) -> dict:
    await asyncio.sleep(delay)
    prompt = prompt_for(request, config)
    body = {
        "model": config.model,
        "prompt": prompt,
        "max_tokens": max(1, min(request.output_length, config.max_output_tokens)),
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = None
    usage = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"ok": False, "prompt_tokens": len(prompt)}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return {"ok": False, "prompt_tokens": len(prompt)}
                if first is None and any(c.get("text") for c in event.get("choices", [])):
                    first = time.perf_counter() - started
                usage = event.get("usage") or usage
    except httpx.HTTPError as exc:
        logger.warning("request %d failed: %s", request.index, exc)
        return {"ok": False, "prompt_tokens": len(prompt)}
    return {
        "ok": usage is not None,
        "ttft": first if first is not None else time.perf_counter() - started,
        "prompt_tokens": len(prompt),
        "output_tokens": usage["completion_tokens"] if usage else 0,
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) if usage else 0,
    }


async def drive(requests: Sequence[TraceRequest], config: DriveConfig) -> DriveResult:
    chosen = list(requests[: config.max_requests])
    if not chosen:
        raise ValueError("the trace has no requests to replay")
    start_at = chosen[0].arrival
    async with httpx.AsyncClient(base_url=config.base_url, timeout=config.timeout) as client:
        began = time.perf_counter()
        outcomes = await asyncio.gather(
            *(_one(client, config, r, (r.arrival - start_at) * config.time_scale) for r in chosen)
        )
        seconds = time.perf_counter() - began
    done = [o for o in outcomes if o["ok"]]
    ttfts = sorted(o["ttft"] for o in done) or [0.0]
    return DriveResult(
        requests=len(chosen),
        failed=len(chosen) - len(done),
        seconds=seconds,
        output_tokens=sum(o["output_tokens"] for o in done),
        prompt_tokens=sum(o["prompt_tokens"] for o in done),
        cached_tokens=sum(o["cached_tokens"] for o in done),
        oracle_cached_tokens=oracle_cached_tokens([r for r, o in zip(chosen, outcomes) if o["ok"]], config),
        ttft_p50_ms=ttfts[len(ttfts) // 2] * 1e3,
        ttft_p90_ms=ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] * 1e3,
        ttft_mean_ms=sum(ttfts) / len(ttfts) * 1e3,
    )
