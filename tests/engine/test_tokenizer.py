"""Tests for kvmesh.engine.tokenizer on the converted default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from kvmesh.engine.tokenizer import ChatTemplateError, Tokenizer

SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
STREAM_TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "emoji: 👋🏽 🚀🔥 family 👨‍👩‍👧‍👦 end",
    "你好，世界！今天天气很好。日本語のテキスト",
    "Grüße aus Köln — naïve café\n\n  def f(x):\treturn 42",
]


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def _bare(template: str | None) -> Tokenizer:
    return Tokenizer(HFTokenizer(models.BPE()), chat_template=template, bos_token="<s>", eos_token="</s>")


def test_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert 2 in tok.eos_token_ids
    assert len(set(tok.eos_token_ids)) == len(tok.eos_token_ids)
    assert tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.token_to_id("no-such-token") is None


def test_encode_decode(tok: Tokenizer) -> None:
    ids = tok.encode("The capital of France is")
    assert ids == [504, 3575, 282, 4649, 314]
    assert tok.encode("The capital of France is", add_special_tokens=True) == ids  # add_bos_token is False
    assert tok.decode(ids) == "The capital of France is"
    chat = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert chat[0] == 1 and chat[-1] == 2
    assert tok.decode(chat) == "user\nhi"
    assert tok.decode(chat, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_add_bos_when_configured(default_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(default_model_dir)
    tok.add_bos_token = True
    assert tok.encode("hi", add_special_tokens=True)[0] == 1
    assert tok.encode("hi")[0] != 1


def test_chat_template_system_and_user(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_user_only_gets_default_system_prompt(tok: Tokenizer) -> None:
    rendered = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert rendered == (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": "user", "content": None}],
        [{"role": 3, "content": "hi"}],
        ["user: hi"],
    ],
)
def test_bad_messages_raise(tok: Tokenizer, messages: object) -> None:
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


def test_no_template_raises() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        _bare(None).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_helpers_raise_exception_and_tojson() -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}{{ eos_token }}{{ extra }}"
    )
    tok = _bare(template)
    rendered = tok.apply_chat_template([{"role": "user", "content": "héllo"}], extra="!")
    assert rendered == '<s>{"role": "user", "content": "héllo"}</s>!'
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_sandbox_blocks_unsafe_access() -> None:
    tok = _bare("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_file_overrides_config(default_model_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((default_model_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "[a]"
    assert tok.eos_token_ids == (2, 0)


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_decode_stream_matches_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    stream = tok.new_decode_stream()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_decode_stream_holds_incomplete_utf8(tok: Tokenizer) -> None:
    ids = tok.encode("🚀")
    assert len(ids) > 1  # a multi-byte char split over byte-level tokens
    stream = tok.new_decode_stream()
    pieces = [stream.step(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🚀"


def test_decode_stream_skips_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    stream = tok.new_decode_stream(skip_special_tokens=True)
    assert "".join(stream.step(i) for i in ids) == "assistant\nHi"


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_decode_stream_fallback_without_native(
    tok: Tokenizer, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvmesh.engine.tokenizer as tokenizer_module

    monkeypatch.delattr(tokenizer_module.decoders, "DecodeStream")
    ids = tok.encode(text)
    stream = tok.new_decode_stream()
    assert "".join(stream.step(i) for i in ids) == text
