"""``n`` choices of a prompt, ``logprobs`` in OpenAI's two shapes, and ``echo``.

``n``: each choice is a request of its own in the mesh (as vLLM v1 runs ``n``: child
requests of one parent), so each keeps its own retries, cancellation and worker; the prompt's
KV is shared through the prefix cache. The first choice of a prompt (its *leader*) starts at
once; the others start when the leader's first token arrives, when its prompt's full blocks
are cached on the worker that prefilled it, and are routed there by the same session
(``x-session-id``, or one made for the request): their prefill reuses those blocks and
computes only the last, partial block. Forking the leader's blocks inside one engine would
save that partial block too, but would tie the ``n`` sequences to one worker and one retry;
the fan-out keeps every mesh path (prefill worker or not, retries after a fault) unchanged.
With a ``seed``, choice ``j`` samples with ``seed + j`` (vLLM's derivation, wrapped into the
seed's range): reproducible, and different from each other; greedy choices are equal.

Logprobs are of the model's raw distribution (``kvmesh.engine.logprobs``). Chat's shape is
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}``;
completions' is ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where
``top_logprobs`` maps the k most likely tokens' text (and the sampled one's: up to k + 1, as
OpenAI says) to their logprob, and ``text_offset`` is each token's character offset in the
choice's ``text`` (which starts with the prompt under ``echo``), from the tokens' texts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.protocol import LogprobSpec, SamplingSpec, TokenEvent
from kvmesh.services.router.openai_api import APIError

__all__ = [
    "ChoiceLogprobs",
    "PromptEcho",
    "after_leader",
    "check_choices",
    "check_prompt_logprobs",
    "choice_sampling",
    "leading",
    "merge_logprobs",
]

# The prompt's logprobs cross NATS in one message (the prefill's answer, or the first event):
# about 40 bytes a token plus 30 per top logprob, kept well under NATS' default 1 MiB.
PROMPT_LOGPROBS_BUDGET = 768 * 1024
MAX_CHOICES = 128  # in one request, n x prompts: each is a request of its own in the mesh


def check_choices(n: int, num_prompts: int) -> None:
    """A 400 for more choices than one request may start."""
    if n * num_prompts > MAX_CHOICES:
        raise APIError(
            400, f"n x prompts may be at most {MAX_CHOICES} choices per request, got {n} x {num_prompts}", param="n"
        )

SEED_MAX = 2**64 - 1  # torch takes [-(2**63), 2**64 - 1], and seeds the same generator mod 2**64


def choice_sampling(spec: SamplingSpec, index: int) -> SamplingSpec:
    """The sampling of a prompt's choice ``index``: its own seed, ``seed + index`` (mod 2**64
    past the largest seed, which is the same generator to torch)."""
    if spec.seed is None or index == 0:
        return spec
    seed = spec.seed + index
    if seed > SEED_MAX:
        seed -= 2**64
    return spec.model_copy(update={"seed": seed})


def check_prompt_logprobs(top: int | None, prompts: list[list[int]]) -> None:
    """A 400 for ``echo`` with logprobs of a prompt whose logprobs would not fit a message."""
    if top is None:
        return
    longest = max(len(ids) for ids in prompts)
    if longest * (40 + 30 * top) > PROMPT_LOGPROBS_BUDGET:
        most = PROMPT_LOGPROBS_BUDGET // (40 + 30 * top)
        raise APIError(
            400,
            f"echo with logprobs={top} is supported for prompts of up to {most} tokens; this one has {longest}",
            param="echo",
        )


# --------------------------------------------------------------------------- leader gating
async def leading(events: AsyncIterator[TokenEvent], started: asyncio.Event) -> AsyncGenerator[TokenEvent, None]:
    """A leader's events; ``started`` is set at its first (or when it ends without one)."""
    try:
        async for event in events:
            started.set()
            yield event
    finally:
        started.set()
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()


async def after_leader(events: AsyncIterator[TokenEvent], started: asyncio.Event) -> AsyncGenerator[TokenEvent, None]:
    """A sibling's events, begun once its leader's first token came (its prompt is cached)."""
    try:
        await started.wait()  # the leader sets it however it ends, and it is bounded by its deadline
        async for event in events:
            yield event
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()


# --------------------------------------------------------------------------- token text
_BYTE_LEVEL_DECODERS = {"ByteLevel"}


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character map, inverted: how a byte-level BPE piece spells its bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenText:
    """A token's text (as the tokenizer decodes it alone, special tokens included) and its
    UTF-8 bytes (the token's own bytes for byte-level BPE, which may be part of a character)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer.backend, "decoder", None)
        self._byte_level = type(decoder).__name__ in _BYTE_LEVEL_DECODERS if decoder is not None else False
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = self._raw_bytes(token_id)
            cached = (text, list(raw if raw is not None else text.encode("utf-8")))
            if len(self._cache) < 65536:
                self._cache[token_id] = cached
        return cached

    def _raw_bytes(self, token_id: int) -> bytes | None:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return None
        if self._byte_level:
            alphabet = _byte_level_alphabet()
            if all(ch in alphabet for ch in piece):
                return bytes(alphabet[ch] for ch in piece)
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # sentencepiece byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return None
        return None


# --------------------------------------------------------------------------- logprobs
class ChoiceLogprobs:
    """One choice's logprobs as it streams: each event's fragment in its endpoint's shape."""

    def __init__(self, text: TokenText, *, chat: bool, top: int, offset: int = 0) -> None:
        self.text = text
        self.chat = chat
        self.top = top
        self.offset = offset  # completions' text_offset of the next token

    def fragment(self, token_ids: list[int], logprobs: list[LogprobSpec | None] | None) -> dict[str, Any]:
        """The logprobs object of these tokens (a chunk's, or a part of the whole answer's)."""
        values = list(logprobs or [])
        values += [None] * (len(token_ids) - len(values))
        if self.chat:
            return {"content": [self._chat_entry(t, v) for t, v in zip(token_ids, values)], "refusal": None}
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, value in zip(token_ids, values):
            text, _ = self.text.get(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if value is None else value.lp)
            out["top_logprobs"].append(None if value is None else self._completion_top(value))
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def _chat_entry(self, token: int, value: LogprobSpec | None) -> dict[str, Any]:
        text, raw = self.text.get(token)
        tops = []
        for top_id, top_lp in (value.top if value is not None else [])[: self.top]:
            top_text, top_raw = self.text.get(top_id)
            tops.append({"token": top_text, "logprob": top_lp, "bytes": top_raw})
        return {"token": text, "logprob": value.lp if value is not None else None, "bytes": raw, "top_logprobs": tops}

    def _completion_top(self, value: LogprobSpec) -> dict[str, float]:
        tops: dict[str, float] = {}
        for top_id, top_lp in value.top[: self.top]:
            tops.setdefault(self.text.get(top_id)[0], top_lp)
        tops.setdefault(self.text.get(value.t)[0], value.lp)  # the sampled token's, always
        return tops


def merge_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fragments of one choice, as one logprobs object."""
    if not parts:
        return None
    merged: dict[str, Any] = {key: ([] if isinstance(value, list) else value) for key, value in parts[0].items()}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, list):
                merged[key].extend(value)
    return merged


@dataclass(slots=True)
class PromptEcho:
    """A completions prompt under ``echo``: its text, prepended to each of its choices, and
    (with logprobs) its tokens' logprobs, which its leader's first event brings."""

    text: str
    token_ids: list[int]
    logprobs: list[LogprobSpec | None] | None = None
    wants_logprobs: bool = False
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self, event: TokenEvent) -> None:
        if event.prompt_logprobs is not None and self.logprobs is None:
            self.logprobs = event.prompt_logprobs
            self.arrived.set()

    def fragment(self, logprobs: ChoiceLogprobs | None) -> dict[str, Any] | None:
        """The prompt's part of a choice's logprobs (its first token has none)."""
        if logprobs is None or not self.wants_logprobs:
            return None
        return logprobs.fragment(self.token_ids, list(self.logprobs or [])[: len(self.token_ids)])
