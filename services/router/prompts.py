"""A request's prompt as token ids, and its completion budget within the model's context."""

from __future__ import annotations

from kvmesh.engine.tokenizer import ChatTemplateError, Tokenizer
from kvmesh.services.router.openai_api import APIError, ChatCompletionRequest, CompletionRequest

__all__ = ["chat_prompt_ids", "completion_prompt_ids", "resolve_max_tokens"]


def completion_prompt_ids(request: CompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids: a string is encoded with special tokens, ids are range-checked."""
    if isinstance(request.prompt, str):
        ids = tokenizer.encode(request.prompt, add_special_tokens=True)
    else:
        ids = list(request.prompt)
        vocab = tokenizer.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise APIError(
                400, f"prompt token id {bad} is out of range for a vocabulary of {vocab}", param="prompt"
            )
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def chat_prompt_ids(request: ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """The messages rendered by the model's chat template, then encoded without extra specials."""
    try:
        text = tokenizer.apply_chat_template(request.template_messages(), add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from exc
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
