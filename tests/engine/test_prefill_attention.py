"""The compiled bfloat16 prefill attention (csrc/prefill_attention.cpp) against float64 and
against PyTorch's flash attention, and through the engine: where the CPU has no AVX512-BF16 the
kernel is not built and these tests skip (the engine keeps flash attention there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.engine.model import paged_kernel


def _built() -> bool:
    return paged_kernel.compiler() is not None and paged_kernel.available() and bool(torch.ops.kvmesh.prefill_attention_built())


pytestmark = pytest.mark.skipif(not _built(), reason="the bfloat16 prefill kernel is not built here (no AVX512-BF16)")


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).transpose(0, 1).unsqueeze(0)

    out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


@pytest.mark.parametrize(
    ("length", "heads", "kv_heads", "dim"),
    [(1, 9, 3, 64), (2, 9, 3, 64), (16, 9, 3, 64), (17, 9, 3, 64), (100, 4, 4, 128), (33, 8, 1, 64), (300, 9, 3, 64),
     (64, 16, 2, 128)],
)  # fmt: skip
def test_the_kernel_is_as_close_to_float64_as_flash_attention(length: int, heads: int, kv_heads: int, dim: int) -> None:
    """q and k strided slices of one qkv tensor, as the model passes them, v a view with rows
    and heads strided otherwise; every row attends to the keys up to its own. Its error against
    float64 is flash attention's in bfloat16."""
    gen = torch.Generator().manual_seed(length)
    qk = (torch.randn(length, heads + kv_heads, dim, generator=gen) * 2).bfloat16()
    q, k = qk[:, :heads], qk[:, heads:]
    v = torch.randn(length, kv_heads, dim + 8, generator=gen).bfloat16()[..., :dim]
    scale = dim**-0.5
    exact = _causal(q, k, v, scale, torch.float64)
    got = torch.ops.kvmesh.prefill_attention(q, k, v, scale)
    flash = _causal(q, k, v, scale, torch.bfloat16).double()
    assert got.dtype == torch.bfloat16 and got.shape == (length, heads, dim) and got.is_contiguous()
    error, flash_error = (got.double() - exact).abs(), (flash - exact).abs()
    assert error.max() <= 1.5 * flash_error.max() + 1e-3
    assert error.mean() <= 1.1 * flash_error.mean() + 1e-5


def test_bad_inputs_are_refused_by_name() -> None:
    q = torch.zeros(4, 6, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        torch.ops.kvmesh.prefill_attention(q.float(), q[:, :2].float(), q[:, :2].float(), 0.125)
    with pytest.raises(RuntimeError, match="no kernel for this head dim"):
        small = torch.zeros(4, 6, 16, dtype=torch.bfloat16)
        torch.ops.kvmesh.prefill_attention(small, small[:, :2], small[:, :2], 0.25)
    with pytest.raises(RuntimeError, match="no kernel for this head dim or group"):  # 9 query heads a KV head
        wide = torch.zeros(4, 18, 64, dtype=torch.bfloat16)
        torch.ops.kvmesh.prefill_attention(wide, wide[:, :2], wide[:, :2], 0.125)
    with pytest.raises(RuntimeError, match="shapes"):
        torch.ops.kvmesh.prefill_attention(q, q[:3, :2], q[:3, :2], 0.125)


def test_the_engine_prefills_through_it_with_the_logprobs_of_flash_attention(tmp_path, monkeypatch) -> None:
    """A bfloat16 engine on a model of 64-dim heads uses the kernel where the CPU has no AMX
    (every layer, every prompt: counted); its prompt logprobs are as close to a float32
    engine's as those with flash attention (the kernel forced off): measured 0.109 against
    0.113 at most, 0.030 against 0.030 on average."""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams
    from kvmesh.testing.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny64", arch="llama", seed=1, hidden_size=256, num_heads=4, num_kv_heads=2)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", block_size=4, num_blocks=256, enable_prefix_caching=False))
    assert engine.model.prefill_kernel == paged_kernel.prefill_attention_wanted(64, 2)
    assert not paged_kernel.prefill_attention_wanted(16, 2) and not paged_kernel.prefill_attention_wanted(64, 9)
    prompts = [[5 + (i * 7) % 200 for i in range(n)] for n in (3, 40, 90)]
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    real, calls = torch.ops.kvmesh.prefill_attention, []

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(torch.ops.kvmesh, "prefill_attention", counted)
    runs = []
    for flag in (True, False):
        engine.model.prefill_kernel = flag
        runs.append(engine.generate(prompts, params))
        if flag:
            assert sorted(calls) == sorted([3, 40, 90] * len(engine.model.layers))
    assert len(calls) == 3 * len(engine.model.layers)  # none with the kernel off
    exact = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", block_size=4, num_blocks=256, enable_prefix_caching=False))
    reference = exact.generate(prompts, params)

    def errors(outputs) -> list[float]:  # each prompt token's logprob against float32's
        return [abs(got.logprob - want.logprob)
                for out, ref in zip(outputs, reference, strict=True)
                for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True)]  # fmt: skip

    kernel_errors, flash_errors = errors(runs[0]), errors(runs[1])
    assert len(kernel_errors) == sum(n - 1 for n in (3, 40, 90))
    assert max(kernel_errors) <= 1.5 * max(flash_errors) + 0.02
    assert sum(kernel_errors) <= 1.2 * sum(flash_errors) + 0.01 * len(kernel_errors)
    assert all(len(out.new_token_ids) == 4 for out in runs[0])
