"""Tests for the GGUF -> HF directory converter (kvmesh.engine.loader.gguf_convert).

The reference is transformers' own, independent GGUF loader (dequantization and Q/K un-permutation).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvmesh.engine.loader import gguf_convert
from kvmesh.engine.loader.default_model import find_default_gguf
from kvmesh.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TOKENIZER_TEXTS = [
    "The capital of France is",
    "12345",
    "Call 555-0123 before 9:30, or 2024 ends.",
    "def add(a, b):\n    return a + b  # sum\n",
    "emoji: 👋🏽 🚀🔥 family 👨‍👩‍👧‍👦 end",
    "你好，世界！今天天气很好。",
    "   leading spaces,\ttabs\n\nand newlines  ",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def model_dir(default_model_dir: Path) -> Path:
    return default_model_dir


@pytest.fixture(scope="module")
def config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def ours(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def reference_state_dict(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors as transformers' GGUF loader produces them.

    ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` needs ``accelerate``; without it we
    call the same loader function directly (dequantize + reverse Q/K permutation).
    """
    gguf_path = find_default_gguf()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        return {k: v.detach() for k, v in model.state_dict().items()}
    except ValueError as exc:
        if "accelerate" not in str(exc):
            raise
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    return parsed["tensors"]


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for n_head in (1, 2, 3, 6):
        np.testing.assert_array_equal(gguf_convert._unpermute(_permute(w, n_head), n_head), w)
    np.testing.assert_array_equal(gguf_convert._unpermute(_permute(w[:, 0], 3), 3), w[:, 0])


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulated crash")
        yield  # pragma: no cover

    monkeypatch.setattr(gguf_convert, "_convert_tensors", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        gguf_convert.convert_gguf(find_default_gguf(), tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_refuses_non_empty_output_dir(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        gguf_convert.convert_gguf(find_default_gguf(), tmp_path)


def _byte_alphabet() -> list[str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp convert_hf_to_gguf.py
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path: Path, arch: str) -> dict[str, np.ndarray]:
    """A tiny F32 GGUF with an untied ``output.weight``; returns the HF tensors it encodes."""
    import gguf

    hidden, ffn, heads, kv_heads, layers = 16, 32, 4, 2, 2
    head_dim = hidden // heads
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + _byte_alphabet() + ["Ġt", "he", "Ġthe"]
    merges = ["Ġ t", "h e", "Ġt he"]
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    hf: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rand(len(tokens), hidden),
        "lm_head.weight": rand(len(tokens), hidden),
        "model.norm.weight": rand(hidden),
    }
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    writer.add_tensor("output.weight", hf["lm_head.weight"])
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"])
    for i in range(layers):
        pre = f"model.layers.{i}."
        layer = {
            "attn_norm.weight": ("input_layernorm.weight", rand(hidden)),
            "ffn_norm.weight": ("post_attention_layernorm.weight", rand(hidden)),
            "attn_q.weight": ("self_attn.q_proj.weight", rand(heads * head_dim, hidden)),
            "attn_k.weight": ("self_attn.k_proj.weight", rand(kv_heads * head_dim, hidden)),
            "attn_v.weight": ("self_attn.v_proj.weight", rand(kv_heads * head_dim, hidden)),
            "attn_output.weight": ("self_attn.o_proj.weight", rand(hidden, heads * head_dim)),
            "ffn_gate.weight": ("mlp.gate_proj.weight", rand(ffn, hidden)),
            "ffn_up.weight": ("mlp.up_proj.weight", rand(ffn, hidden)),
            "ffn_down.weight": ("mlp.down_proj.weight", rand(hidden, ffn)),
        }
        if arch == "qwen2":
            layer["attn_q.bias"] = ("self_attn.q_proj.bias", rand(heads * head_dim))
            layer["attn_k.bias"] = ("self_attn.k_proj.bias", rand(kv_heads * head_dim))
            layer["attn_v.bias"] = ("self_attn.v_proj.bias", rand(kv_heads * head_dim))
        for gguf_name, (hf_name, value) in layer.items():
            hf[pre + hf_name] = value
            stored = value
            if arch == "llama" and gguf_name.startswith(("attn_q.", "attn_k.")):
                stored = _permute(value, heads if gguf_name.startswith("attn_q.") else kv_heads)
            writer.add_tensor(f"blk.{i}.{gguf_name}", np.ascontiguousarray(stored))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_untied_gguf_round_trip(tmp_path: Path, arch: str) -> None:
    hf = _write_tiny_gguf(tmp_path / "tiny.gguf", arch)
    out = gguf_convert.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["architectures"] == ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is False
    assert config["attention_bias"] is (arch == "qwen2")
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(hf)
    for name, value in hf.items():
        np.testing.assert_array_equal(tensors[name].numpy(), value, err_msg=name)

    tokenizer = Tokenizer.from_dir(out)
    assert tokenizer.encode("<|im_start|> the") == [1, tokenizer.token_to_id("Ġthe")]
    assert tokenizer.eos_token_ids == (2,)
    model_cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    model = model_cls.from_pretrained(str(out), dtype=torch.float32)
    assert torch.equal(model.lm_head.weight.detach(), tensors["lm_head.weight"])
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (8, 16)


@pytest.mark.slow
def test_directory_layout(model_dir: Path) -> None:
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert not [n for n in names if n.startswith(".")]


@pytest.mark.slow
def test_config(config: dict[str, Any], model_dir: Path) -> None:
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    assert {k: config.get(k) for k in expected} == expected
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["bos_token_id"] == 1 and generation["eos_token_id"] == 2
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is False
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["chat_template"].startswith("{% for message in messages %}")


@pytest.mark.slow
def test_tensor_names_and_dtypes(ours: dict[str, torch.Tensor]) -> None:
    assert "lm_head.weight" not in ours  # tied embeddings
    assert ours["model.embed_tokens.weight"].shape == (49152, 576)
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ours["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert ours["model.norm.weight"].shape == (576,)
    assert len(ours) == 2 + 30 * 9
    assert all(t.dtype == torch.float32 for t in ours.values())


@pytest.mark.slow
def test_tensors_match_transformers_gguf_loader(
    ours: dict[str, torch.Tensor], reference_state_dict: dict[str, torch.Tensor]
) -> None:
    for name, tensor in ours.items():
        ref = reference_state_dict[name].to(torch.float32)
        assert tensor.shape == ref.shape, name
        torch.testing.assert_close(tensor, ref, rtol=0, atol=1e-6, msg=name)
    q = ours["model.layers.3.self_attn.q_proj.weight"]
    k = ours["model.layers.3.self_attn.k_proj.weight"]
    assert torch.equal(q, reference_state_dict["model.layers.3.self_attn.q_proj.weight"])
    assert torch.equal(k, reference_state_dict["model.layers.3.self_attn.k_proj.weight"])


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(model_dir: Path) -> None:
    gguf_path = find_default_gguf()
    reference = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer = Tokenizer.from_dir(model_dir)
    for text in TOKENIZER_TEXTS:
        assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


@pytest.mark.slow
def test_greedy_decoding_says_paris(model_dir: Path) -> None:
    model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    tokenizer = Tokenizer.from_dir(model_dir)
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=2)
    text = tokenizer.decode(out[0, ids.shape[1]:].tolist())
    assert text.startswith(" Paris"), text
