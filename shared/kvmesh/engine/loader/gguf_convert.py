"""Convert a GGUF checkpoint into a Hugging Face style model directory.

The output directory holds ``config.json``, ``model.safetensors`` (float32, HF tensor names),
``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``. It is written to a
temporary sibling directory first and renamed into place, so a crash never leaves a half-written
model behind.

Supported architectures: ``llama`` (the default SmolLM2 model) and ``qwen2``. Supported tokenizer:
``tokenizer.ggml.model == "gpt2"`` (byte-level BPE).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from kvmesh.errors import ModelLoadError

logger = logging.getLogger(__name__)

__all__ = ["GGUFConversionError", "convert_gguf"]

# llama.cpp token types (gguf.TokenType): 3 = CONTROL, 4 = USER_DEFINED.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split regexes for ``tokenizer.ggml.pre`` values that are not plain GPT-2.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEXES = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}

# GGUF per-layer tensor name -> HF per-layer tensor name (without the ``model.layers.{i}.`` prefix).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFConversionError(ModelLoadError):
    """The GGUF file cannot be converted (unsupported architecture, tokenizer or missing data)."""


@dataclass(slots=True, frozen=True)
class _ArchSpec:
    model_type: str
    architecture: str
    permute_qk: bool
    attention_bias: bool


_ARCHS = {
    "llama": _ArchSpec("llama", "LlamaForCausalLM", permute_qk=True, attention_bias=False),
    "qwen2": _ArchSpec("qwen2", "Qwen2ForCausalLM", permute_qk=False, attention_bias=True),
}


@dataclass(slots=True)
class _ModelDims:
    num_layers: int
    num_heads: int
    num_kv_heads: int


def convert_gguf(
    gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """Convert ``gguf_path`` into an HF-style model directory at ``out_dir`` and return its path.

    ``out_dir`` must not exist, or be an empty directory, unless ``overwrite`` is true.
    """
    src = Path(gguf_path)
    dst = Path(out_dir)
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    if dst.exists() and not overwrite and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"output directory already exists and is not empty: {dst}")

    started = time.perf_counter()
    logger.info("converting GGUF %s -> %s", src, dst)
    reader = gguf.GGUFReader(src)
    arch_name = _require(reader, "general.architecture")
    spec = _ARCHS.get(arch_name)
    if spec is None:
        raise GGUFConversionError(
            f"unsupported GGUF architecture {arch_name!r} in {src}; supported: {sorted(_ARCHS)}"
        )

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        config = _build_config(reader, arch_name, spec)
        dims = _ModelDims(
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config["num_key_value_heads"],
        )
        tensors = dict(_convert_tensors(reader, spec, dims))
        _check_tensors(tensors, dims, config)
        logger.info("dequantized %d tensors in %.1fs", len(tensors), time.perf_counter() - started)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors

        tokenizer, tok_config = _build_tokenizer(reader, config)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tok_config)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(config))
        _move_into_place(tmp, dst, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s in %.1fs", src.name, time.perf_counter() - started)
    return dst


# --------------------------------------------------------------------------- metadata


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _require(reader: gguf.GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise GGUFConversionError(f"GGUF metadata key {key!r} is missing")
    return value


def _build_config(reader: gguf.GGUFReader, arch: str, spec: _ArchSpec) -> dict[str, Any]:
    hidden = int(_require(reader, f"{arch}.embedding_length"))
    n_heads = int(_require(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // n_heads))
    tensor_names = {t.name for t in reader.tensors}
    embd = _tensor(reader, "token_embd.weight")
    vocab_size = int(embd.shape[-1])  # GGML order: [hidden, vocab]

    config: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_require(reader, f"{arch}.feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "num_hidden_layers": int(_require(reader, f"{arch}.block_count")),
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": spec.attention_bias or "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    # float32 metadata like 9.999999747378752e-06 is really 1e-5; keep the value readable.
    config["rms_norm_eps"] = float(np.format_float_positional(np.float32(config["rms_norm_eps"]), unique=True))
    rope_scaling = _rope_scaling(reader, arch)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if spec.model_type == "qwen2":
        config["use_sliding_window"] = False
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        value = _field(reader, gguf_key)
        if value is not None:
            config[hf_key] = int(value)
    return config


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind != "linear" or factor is None:
        raise GGUFConversionError(f"unsupported rope scaling {kind!r} in GGUF metadata")
    return {"rope_type": "linear", "factor": float(factor)}


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in config:
            out[key] = config[key]
    return out


# --------------------------------------------------------------------------- tensors


def _tensor(reader: gguf.GGUFReader, name: str) -> Any:
    for tensor in reader.tensors:
        if tensor.name == name:
            return tensor
    raise GGUFConversionError(f"GGUF tensor {name!r} is missing")


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None


def _unpermute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q/K projection (weight or bias)."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise GGUFConversionError(f"cannot un-permute {rows} rows over {n_head} heads")
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _convert_tensors(
    reader: gguf.GGUFReader, spec: _ArchSpec, dims: _ModelDims
) -> Iterator[tuple[str, np.ndarray]]:
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            logger.warning("skipping unknown GGUF tensor %s", tensor.name)
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if spec.permute_qk:
            if ".attn_q." in tensor.name:
                values = _unpermute(values, dims.num_heads)
            elif ".attn_k." in tensor.name:
                values = _unpermute(values, dims.num_kv_heads)
        yield name, np.ascontiguousarray(values)


def _check_tensors(tensors: dict[str, np.ndarray], dims: _ModelDims, config: dict[str, Any]) -> None:
    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        expected.append("lm_head.weight")
    per_layer = [v for v in _LAYER_TENSORS.values() if not v.endswith(".bias")]
    if config["attention_bias"]:
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    expected += [f"model.layers.{i}.{n}" for i in range(dims.num_layers) for n in per_layer]
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise GGUFConversionError(f"GGUF is missing {len(missing)} tensors, e.g. {missing[:3]}")


# --------------------------------------------------------------------------- tokenizer


def _build_tokenizer(
    reader: gguf.GGUFReader, config: dict[str, Any]
) -> tuple[HFTokenizer, dict[str, Any]]:
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFConversionError(
            f"unsupported GGUF tokenizer model {kind!r}; only byte-level BPE ('gpt2') is supported"
        )
    tokens: list[str] = list(_require(reader, "tokenizer.ggml.tokens"))
    token_types: list[int] = list(_field(reader, "tokenizer.ggml.token_type", []) or [])
    merges_raw: list[str] = list(_field(reader, "tokenizer.ggml.merges", []) or [])

    vocab: dict[str, int] = {}
    for idx, token in enumerate(tokens):
        if token in vocab:
            logger.warning("duplicate token %r at ids %d and %d; keeping the first", token, vocab[token], idx)
            continue
        vocab[token] = idx
    merges = [(left, right) for left, right in (m.split(" ", 1) for m in merges_raw)]

    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    special = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind_ in zip(tokens, token_types)
        if kind_ == _TOKEN_TYPE_CONTROL
    ]
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind_ in zip(tokens, token_types)
        if kind_ == _TOKEN_TYPE_USER_DEFINED
    ]
    if special:
        tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)

    def token_at(key: str) -> str | None:
        idx = _field(reader, key)
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    return tokenizer, tok_config


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = _SPLIT_REGEXES.get(pre)
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
    if pre not in ("gpt2", "default"):
        logger.warning("unknown GGUF pre-tokenizer %r; using plain GPT-2 byte-level splitting", pre)
    return byte_level


# --------------------------------------------------------------------------- output


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _move_into_place(tmp: Path, dst: Path, *, overwrite: bool) -> None:
    os.chmod(tmp, 0o755)  # mkdtemp creates 0o700; the model directory is meant to be shared
    for child in tmp.iterdir():
        os.chmod(child, 0o644)
        _fsync(child)
    if dst.is_dir() and not any(dst.iterdir()):
        dst.rmdir()
    if dst.exists():
        if not overwrite:
            raise FileExistsError(f"output directory appeared while converting: {dst}")
        trash = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.replace(dst, trash / dst.name)
        os.replace(tmp, dst)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, dst)


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
