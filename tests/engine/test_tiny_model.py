"""Tests for the offline tiny random-weight model builder (kvmesh.testing.tiny_model)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from kvmesh.testing.tiny_model import build_tiny_model

transformers = pytest.importorskip("transformers")

ARCHS = ["llama", "qwen2"]
PROMPTS = ["The river begins high in the mountains", "def add(a, b):"]
ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "Grüße aus Köln — naïve café, señor, Ærøskøbing",
    "日本語のテキストと 中文 and 한국어",
    "emoji: 👋🏽 🚀🔥 family 👨‍👩‍👧‍👦 end",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "<|im_start|>user\nhi there<|im_end|>\n",
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: build_tiny_model(root / arch, arch=arch) for arch in ARCHS}


def _tensor_names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("arch", ARCHS)
def test_directory_layout_and_config(model_dirs: dict[str, Path], arch: str) -> None:
    d = model_dirs[arch]
    for name in ["tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json", "model.safetensors"]:
        assert (d / name).is_file(), name
    config = json.loads((d / "config.json").read_text())
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert config["vocab_size"] == tok.get_vocab_size(with_added_tokens=True)
    assert config["head_dim"] == config["hidden_size"] // config["num_attention_heads"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert [tok.token_to_id(t) for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]] == [0, 1, 2]
    names = _tensor_names(d)
    has_bias = any(n.endswith("q_proj.bias") for n in names)
    if arch == "llama":
        assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
        assert not has_bias
    else:
        assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
        assert config["use_sliding_window"] is False
        assert {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"} <= names
    assert "lm_head.weight" in names
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and tok_cfg["add_bos_token"] is False


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_model_and_tokenizer(model_dirs: dict[str, Path], arch: str) -> None:
    d = model_dirs[arch]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.vocab_size == json.loads((d / "config.json").read_text())["vocab_size"]
    assert model.dtype == torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(d)
    assert len(tokenizer) == model.config.vocab_size
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trip(model_dirs: dict[str, Path], arch: str, text: str) -> None:
    d = model_dirs[arch]
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    hf = transformers.AutoTokenizer.from_pretrained(d)
    raw_ids = raw.encode(text).ids
    assert hf(text)["input_ids"] == raw_ids  # transformers and the raw file tokenize alike
    assert raw.decode(raw_ids, skip_special_tokens=False) == text
    assert hf.decode(raw_ids) == text


def test_same_seed_is_byte_identical_and_seeds_differ(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4)
    for name in ["tokenizer.json", "model.safetensors", "config.json", "tokenizer_config.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    d = build_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in _tensor_names(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_is_not_degenerate(model_dirs: dict[str, Path], arch: str) -> None:
    d = model_dirs[arch]
    tokenizer = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    generated: list[list[int]] = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            logits = model(out).logits[0]
        new = out[0, ids.shape[1]:].tolist()
        assert len(new) == 20
        assert len(set(new)) >= 5, f"degenerate greedy output for {prompt!r}: {new}"
        top2 = logits.topk(2, dim=-1).values
        gaps = top2[:, 0] - top2[:, 1]
        assert gaps.median() > 1e-2
        assert (gaps < 1e-3).float().mean() < 0.05
        generated.append(new)
    assert generated[0] != generated[1]


def test_build_is_fast(tmp_path: Path) -> None:
    start = time.perf_counter()
    build_tiny_model(tmp_path / "fast", arch="qwen2", seed=7)
    assert time.perf_counter() - start < 10.0
