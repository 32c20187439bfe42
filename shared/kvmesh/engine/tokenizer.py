"""Tokenizer wrapper: encode/decode, chat templates and streaming detokenization.

Wraps a ``tokenizers.Tokenizer`` loaded from an HF-style model directory (``tokenizer.json`` plus
``tokenizer_config.json``, optional ``chat_template.jinja``, ``generation_config.json`` and
``config.json``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders
from kvmesh.errors import ModelLoadError

logger = logging.getLogger(__name__)

__all__ = ["ChatTemplateError", "DecodeStream", "Tokenizer", "TokenizerLoadError"]


class ChatTemplateError(ValueError):
    """There is no chat template, the messages are malformed, or the template failed to render."""


class TokenizerLoadError(ModelLoadError):
    """The model directory lacks a usable tokenizer."""


class DecodeStream(Protocol):
    """Incremental detokenizer: ``step`` returns the newly completed text ("" if none yet)."""

    def step(self, token_id: int) -> str: ...


@dataclass(slots=True)
class _SpecialTokens:
    bos: str | None = None
    eos: str | None = None
    unk: str | None = None
    pad: str | None = None


class Tokenizer:
    """A model's tokenizer and chat template."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self._special = _SpecialTokens(bos=bos_token, eos=eos_token, unk=unk_token, pad=pad_token)
        self.add_bos_token = add_bos_token
        ids = list(eos_token_ids)
        eos_id = self.token_to_id(eos_token) if eos_token else None
        if eos_id is not None:
            ids.append(eos_id)
        self._eos_ids = tuple(dict.fromkeys(int(i) for i in ids))
        self._template: jinja2.Template | None = None

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load from an HF-style model directory."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerLoadError(f"no tokenizer.json in {root}")
        tokenizer = HFTokenizer.from_file(str(tok_file))
        tok_config = _read_json(root / "tokenizer_config.json")
        generation = _read_json(root / "generation_config.json")
        model_config = _read_json(root / "config.json")

        template_file = root / "chat_template.jinja"
        chat_template = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else _select_template(tok_config.get("chat_template"))
        )
        eos_ids = [*_as_ids(generation.get("eos_token_id")), *_as_ids(model_config.get("eos_token_id"))]
        return cls(
            tokenizer,
            chat_template=chat_template,
            bos_token=_token_content(tok_config.get("bos_token")),
            eos_token=_token_content(tok_config.get("eos_token")),
            unk_token=_token_content(tok_config.get("unk_token")),
            pad_token=_token_content(tok_config.get("pad_token")),
            add_bos_token=bool(tok_config.get("add_bos_token", False)),
            eos_token_ids=eos_ids,
        )

    # ------------------------------------------------------------------ properties

    @property
    def backend(self) -> HFTokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self._special.bos

    @property
    def eos_token(self) -> str | None:
        return self._special.eos

    @property
    def pad_token(self) -> str | None:
        return self._special.pad

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self._special.bos) if self._special.bos else None

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self._special.pad) if self._special.pad else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; a BOS is prepended only if configured and ``add_special_tokens``."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            bos = self.bos_token_id
            if bos is not None and (not ids or ids[0] != bos):
                ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def new_decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        """An incremental detokenizer for one generated sequence."""
        if hasattr(decoders, "DecodeStream"):
            return _NativeDecodeStream(self._tok, skip_special_tokens)
        return _PrefixDecodeStream(self, skip_special_tokens)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render ``messages`` with the model's chat template (HF semantics)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template")
        _validate_messages(messages)
        template = self._compiled_template()
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._special.bos or "",
                eos_token=self._special.eos or "",
                **extra,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc

    def _compiled_template(self) -> jinja2.Template:
        if self._template is None:
            assert self.chat_template is not None
            env = _template_env()
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as exc:
                raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        return self._template


# ---------------------------------------------------------------------- decode streams


class _NativeDecodeStream:
    __slots__ = ("_tok", "_stream")

    def __init__(self, tokenizer: HFTokenizer, skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok, int(token_id)) or ""


class _PrefixDecodeStream:
    """Fallback for ``tokenizers`` without ``DecodeStream``: decode a window and emit the new suffix."""

    __slots__ = ("_tok", "_skip", "_ids", "_prefix_offset", "_read_offset")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def step(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        text = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(prefix) :]


# ---------------------------------------------------------------------- helpers


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerLoadError(f"invalid JSON in {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"expected a JSON object in {path}")
    return data


def _token_content(value: Any) -> str | None:
    """Special tokens appear as a string or as an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _select_template(value: Any) -> str | None:
    """``chat_template`` may be a string or a list of ``{"name", "template"}``; pick ``default``."""
    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"message {i} is not a dict")
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"message {i} needs a string 'role'")
        if not isinstance(message.get("content"), str):
            raise ChatTemplateError(f"message {i} needs a string 'content'")


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _template_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
