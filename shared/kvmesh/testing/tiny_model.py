"""Offline builder of a tiny random-weight Llama / Qwen2 model directory for fast tests.

``build_tiny_model`` writes a Hugging Face style directory (tokenizer.json,
tokenizer_config.json, config.json, generation_config.json, model.safetensors)
that ``transformers`` can load with ``from_pretrained``. Everything is built
locally and deterministically from ``seed``: the tokenizer is a byte-level BPE
trained on an embedded English corpus, and the weights are drawn from a seeded
``torch.Generator`` with an init scaled so greedy decoding is not degenerate.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

logger = logging.getLogger(__name__)

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2's pre-tokenizer split. transformers>=5 loads qwen2 tokenizers through
# ``Qwen2Tokenizer``, which rebuilds the pipeline as NFC + this regex split +
# ByteLevel(use_regex=False); qwen2 builds use the same pipeline in tokenizer.json
# so that the raw ``tokenizers`` file and the transformers tokenizer agree.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Untied lm_head gain: logits get std ~LM_HEAD_GAIN, so greedy top-2 gaps are
# far above float32 batching/chunking noise while sampling stays non-trivial.
LM_HEAD_GAIN = 4.0

_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}

TRAINING_CORPUS = """\
The river begins high in the mountains, where snow melts each spring and feeds a
hundred small streams. By the time it reaches the plains it is wide and slow, and
farmers along its banks grow wheat, barley, rice and cotton. The capital city sits
on a delta where the river meets the sea, and its harbour is one of the busiest in
the region. Ships arrive from distant ports carrying coffee, spices, machinery and
timber, and they leave loaded with grain, textiles and copper ore.

North of the delta lies a dry plateau. Rainfall there is rare, and the few towns
cluster around deep wells and old stone reservoirs. Travellers who cross the
plateau in summer should carry plenty of water, a wide hat and a good map, because
the roads are long and the villages are far apart. In winter the nights are cold,
and frost covers the rocks until the sun climbs above the eastern ridge.

The islands to the south have a warm, humid climate. Volcanoes formed them millions
of years ago, and the soil is dark and fertile. Forests of palm, fig and mahogany
cover the hills, while coral reefs protect the beaches from heavy waves. Fishing
and tourism are the main industries, and visitors often come to dive, sail, hike
to the crater lakes or simply rest in the shade.

To make a simple tomato soup, start by chopping two onions and three cloves of
garlic. Warm a spoon of olive oil in a heavy pot over medium heat, then add the
onions and cook them slowly until they are soft and golden. Stir in the garlic, a
pinch of salt and some black pepper. Add one kilogram of ripe tomatoes, cut into
quarters, and half a litre of vegetable stock. Let the soup simmer for twenty
minutes, then blend it until smooth. Taste it, adjust the seasoning, and serve it
hot with fresh bread, a little cream and a few leaves of basil.

Bread needs only flour, water, salt and yeast, but patience matters most. Mix the
ingredients, knead the dough for ten minutes until it feels elastic, and leave it
covered in a warm place. After an hour it should double in size. Shape it gently,
let it rise again, and bake it in a very hot oven. A tray of water on the lowest
shelf makes steam, which helps the crust become crisp and brown.

For dessert, slice apples thinly and arrange them in a buttered dish. Sprinkle
them with sugar, cinnamon and lemon juice. Rub cold butter into flour and oats
until the mixture looks like coarse crumbs, spread it over the fruit and bake for
forty minutes. Serve it warm with yogurt or vanilla ice cream.

A program is a list of instructions that a computer follows. Most programs read
some input, transform it, and write some output. In Python, a function is defined
with the def keyword, followed by its name, its parameters and a colon:

    def add(a: int, b: int) -> int:
        return a + b

    for index, value in enumerate([3, 1, 4, 1, 5, 9, 2, 6]):
        if value % 2 == 0:
            print(index, value)

Good code is easy to read. Choose clear names, keep each function small, and write
tests that check the behaviour you care about. When a test fails, read the error
message carefully: it usually tells you the file, the line and the value that was
unexpected. Version control lets you record every change, compare revisions and
return to an earlier state when an experiment goes wrong.

A hash table stores keys and values so that lookups take constant time on average.
A queue returns items in the order they were added, while a stack returns the most
recent item first. Sorting a list of n numbers with a comparison sort needs about
n log n comparisons. Caching the results of expensive computations can make a
server much faster, but the cache must be invalidated when the data changes, and
memory is always limited, so an eviction policy such as least recently used is
often chosen.

Large language models generate text one token at a time. Each new token depends
on all of the previous ones, so the server keeps the attention keys and values in
a cache. Requests that share a common prefix, such as the same system prompt, can
reuse those cached blocks instead of computing them again. Batching many requests
together keeps the accelerator busy, and splitting a long prompt into chunks keeps
the latency of other requests low.

Questions and answers: What is the tallest mountain? How far is the moon? Why is
the sky blue? Who wrote this letter, and when did it arrive? The meeting starts at
9:30 on Monday, 14 March 2022, in room 101. Please bring 2 copies of the report,
a laptop and a charger. Prices rose by 3.5% last year; the total was $1,250.00.
Email: team@example.com, phone: +1 (555) 010-2030. Visit https://example.org/docs
for details. "Hello," she said, "it's nice to meet you!" He replied: 'Likewise.'
"""


def _train_tokenizer(vocab_target: int, arch: str) -> Tokenizer:
    """Train a deterministic byte-level BPE tokenizer on ``TRAINING_CORPUS``."""
    tokenizer = Tokenizer(models.BPE())
    if arch == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_CORPUS.splitlines(keepends=True), trainer=trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        actual_id = tokenizer.token_to_id(token)
        if actual_id != expected_id:
            raise RuntimeError(f"special token {token!r} got id {actual_id}, expected {expected_id}")
    return tokenizer


def _tokenizer_config(max_position_embeddings: int) -> dict[str, Any]:
    added_tokens = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens,
        "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
        "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID],
        "pad_token": SPECIAL_TOKENS[PAD_TOKEN_ID],
        "unk_token": SPECIAL_TOKENS[PAD_TOKEN_ID],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
        "chat_template": CHATML_TEMPLATE,
    }


def _model_config(
    arch: str,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    rope_theta: float,
    tie_word_embeddings: bool,
) -> dict[str, Any]:
    architecture, model_type = _ARCHS[arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if arch == "llama":
        config.update({"attention_bias": False, "mlp_bias": False})
    else:  # qwen2: q/k/v carry biases implicitly; no sliding window
        config.update(
            {
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": num_layers,
                "attention_dropout": 0.0,
            }
        )
    return config


def _random_weights(
    arch: str,
    *,
    seed: int,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    tie_word_embeddings: bool,
) -> dict[str, torch.Tensor]:
    """Draw float32 weights with HF names.

    Linear layers use std 1/sqrt(fan_in) (O(1) activations), embeddings std 1 and
    RMSNorm weights 1 + small noise, so logits have O(1) spread and greedy
    decoding varies across positions instead of collapsing to one token. With
    tied embeddings the embedding std drops to 1/sqrt(hidden_size): otherwise the
    current token's own embedding dominates the residual stream and the tied
    lm_head keeps predicting the input token.
    """
    gen = torch.Generator().manual_seed(seed)
    head_dim = hidden_size // num_heads
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    embed_std = 1.0 / math.sqrt(hidden_size) if tie_word_embeddings else 1.0

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=gen)

    def bias(size: int) -> torch.Tensor:
        return 0.1 * torch.randn(size, generator=gen)

    weights: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab_size, hidden_size, generator=gen) * embed_std
    }
    for i in range(num_layers):
        p = f"model.layers.{i}"
        weights[f"{p}.input_layernorm.weight"] = norm(hidden_size)
        weights[f"{p}.self_attn.q_proj.weight"] = linear(q_dim, hidden_size)
        weights[f"{p}.self_attn.k_proj.weight"] = linear(kv_dim, hidden_size)
        weights[f"{p}.self_attn.v_proj.weight"] = linear(kv_dim, hidden_size)
        if arch == "qwen2":
            weights[f"{p}.self_attn.q_proj.bias"] = bias(q_dim)
            weights[f"{p}.self_attn.k_proj.bias"] = bias(kv_dim)
            weights[f"{p}.self_attn.v_proj.bias"] = bias(kv_dim)
        weights[f"{p}.self_attn.o_proj.weight"] = linear(hidden_size, q_dim)
        weights[f"{p}.post_attention_layernorm.weight"] = norm(hidden_size)
        weights[f"{p}.mlp.gate_proj.weight"] = linear(intermediate_size, hidden_size)
        weights[f"{p}.mlp.up_proj.weight"] = linear(intermediate_size, hidden_size)
        weights[f"{p}.mlp.down_proj.weight"] = linear(hidden_size, intermediate_size)
    weights["model.norm.weight"] = norm(hidden_size)
    if not tie_word_embeddings:
        weights["lm_head.weight"] = LM_HEAD_GAIN * linear(vocab_size, hidden_size)
    return {name: t.to(torch.float32).contiguous() for name, t in weights.items()}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def build_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_target: int = 512,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a tiny random-weight HF model directory to ``out_dir`` and return its path.

    The output is byte-identical for identical arguments. ``arch`` is ``"llama"``
    or ``"qwen2"`` (the latter adds q/k/v projection biases).
    """
    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(_ARCHS)}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} not divisible by num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
    if vocab_target <= len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_target {vocab_target} must exceed {len(SPECIAL_TOKENS) + 256}")

    start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(vocab_target, arch)
    tokenizer.save(str(out / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(max_position_embeddings))
    _write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
            "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID],
            "pad_token": SPECIAL_TOKENS[PAD_TOKEN_ID],
            "unk_token": SPECIAL_TOKENS[PAD_TOKEN_ID],
        },
    )

    shape: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
    )
    _write_json(
        out / "config.json",
        _model_config(
            arch,
            max_position_embeddings=max_position_embeddings,
            rope_theta=rope_theta,
            **shape,
        ),
    )
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "pad_token_id": PAD_TOKEN_ID,
            "do_sample": False,
        },
    )
    save_file(_random_weights(arch, seed=seed, **shape), str(out / "model.safetensors"), metadata={"format": "pt"})

    logger.info(
        "built tiny %s model (vocab=%d, hidden=%d, layers=%d) in %s in %.2fs",
        arch, vocab_size, hidden_size, num_layers, out, time.perf_counter() - start,
    )
    return out
