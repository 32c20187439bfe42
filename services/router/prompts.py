"""A request's prompt as token ids, and its completion budget within the model's context.

The prompt functions are blocking (tokenizing, rendering the chat template): the app runs them
off the event loop. A prompt with far more characters than the context could hold as tokens is
refused before it is tokenized.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from kvmesh.engine.tokenizer import ChatTemplateError, Tokenizer
from kvmesh.services.router.openai_api import APIError, ChatCompletionRequest, CompletionRequest, unicode_problem
from kvmesh.services.router.tools import render_messages

__all__ = [
    "PROMPT_CHARS_PER_TOKEN",
    "chat_prompt_ids",
    "check_token_ids",
    "check_min_tokens",
    "check_prompt_chars",
    "completion_prompt_ids",
    "resolve_max_tokens",
]

# No tokenizer of a served model averages more characters per token than this, so a prompt of more
# than PROMPT_CHARS_PER_TOKEN x max_model_len characters cannot fit the context: it is refused
# without spending the CPU time (and memory) of tokenizing it.
PROMPT_CHARS_PER_TOKEN = 16


def check_prompt_chars(chars: int, max_model_len: int, *, param: str) -> None:
    limit = PROMPT_CHARS_PER_TOKEN * max_model_len
    if chars > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{chars} characters, more than that context can hold (at most {limit} characters are "
            "accepted). Please reduce the length of the prompt.",
            param=param,
            code="context_length_exceeded",
        )


def completion_prompt_ids(request: CompletionRequest, tokenizer: Tokenizer, max_model_len: int) -> list[list[int]]:
    """Each prompt's token ids: a string is encoded with special tokens, ids are range-checked."""
    return [_prompt_ids(prompt, tokenizer, max_model_len) for prompt in request.prompts]


def _prompt_ids(prompt: str | list[int], tokenizer: Tokenizer, max_model_len: int) -> list[int]:
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), max_model_len, param="prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    else:
        ids = list(prompt)
        vocab = tokenizer.vocab_size
        in_range = not ids or (min(ids) >= 0 and max(ids) < vocab)  # in C: a long prompt's ids are many
        bad = None if in_range else next(i for i in ids if not 0 <= i < vocab)
        if bad is not None:
            raise APIError(
                400, f"prompt token id {bad} is out of range for a vocabulary of {vocab}", param="prompt"
            )
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def chat_prompt_ids(request: ChatCompletionRequest, tokenizer: Tokenizer, max_model_len: int) -> list[int]:
    """The messages rendered by the model's chat template, then encoded without extra specials."""
    tools = request.tool_set.template_tools() if request.tool_set is not None else []
    chars = sum(len(m.content or "") for m in request.messages) + sum(len(json.dumps(t)) for t in tools)
    check_prompt_chars(chars, max_model_len, param="messages")
    # tools, and tool calls in the history: the template's own format, or kvmesh's fallback (``tools``)
    messages, extra = render_messages(request.template_messages(), request.tool_set, tokenizer.chat_template)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    problem = unicode_problem(text)
    if problem is not None:  # from text decoded once more: a tool call's arguments are JSON in a string
        raise APIError(400, f"messages: the rendered prompt {problem} (from a tool call's arguments?)", param="messages")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "the prompt is empty", param="messages")
    return ids


def resolve_max_tokens(prompt_tokens: int, requested: int | None, max_model_len: int, *, param: str) -> int:
    """The completion budget: as requested if prompt and completion fit, else the rest of the context."""
    if requested is None:
        if prompt_tokens >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{prompt_tokens} tokens, which leaves no room for the completion. Please reduce the length "
                "of the prompt.",
                param=param,
                code="context_length_exceeded",
            )
        return max_model_len - prompt_tokens
    if prompt_tokens + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} in the completion). "
            "Please reduce the length of the prompt or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def check_min_tokens(min_tokens: int | None, budgets: list[int]) -> None:
    """``min_tokens`` fits every choice's completion budget (vLLM refuses it above max_tokens)."""
    if min_tokens and min_tokens > min(budgets):
        raise APIError(
            400, f"min_tokens ({min_tokens}) must not exceed max_tokens ({min(budgets)})", param="min_tokens"
        )


def check_token_ids(token_ids: Iterable[int] | None, vocab_size: int, *, param: str) -> None:
    """Token ids a request names (``logit_bias``'s keys, ``stop_token_ids``) are the vocabulary's."""
    bad = next((t for t in token_ids or () if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"{param} token id {bad} is out of range for a vocabulary of {vocab_size}", param=param)
