"""The compiled decode-attention kernel against the PyTorch gather path and float64."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.model import paged_kernel
from kvmesh.engine.model.attention import DecodeBatch, _decode_attention

pytestmark = pytest.mark.skipif(paged_kernel.compiler() is None, reason="no C++ compiler: the PyTorch path runs")


def test_kernel_builds_and_loads() -> None:
    assert paged_kernel.available(), paged_kernel.last_failure

LAYERS, KV_HEADS, DIM, HEADS, BLOCK = 3, 2, 64, 6, 4


def _case(
    dtype: torch.dtype, lens: list[int], dim: int = DIM, heads: int = HEADS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeBatch, DecodeBatch]:
    gen = torch.Generator().manual_seed(len(lens))
    width = max(-(-n // BLOCK) for n in lens)
    num_blocks = len(lens) * width + 3
    pool = torch.randn(num_blocks, LAYERS, 2, BLOCK, KV_HEADS, dim, generator=gen).to(dtype)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]  # strided like KVCachePool.layer_views
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width).contiguous()
    qkv = torch.randn(len(lens), heads + 2 * KV_HEADS, dim, generator=gen).to(dtype)
    q = qkv[:, :heads]  # a strided slice, as in the model
    keys = torch.arange(width * BLOCK)
    bias = torch.zeros(len(lens), width * BLOCK).masked_fill_(keys[None] >= torch.tensor(lens)[:, None], float("-inf"))
    gathered = DecodeBatch(tables, bias.view(len(lens), 1, 1, -1))
    kernel = DecodeBatch(tables, None, None, torch.tensor(lens))
    return q, k_cache, v_cache, gathered, kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lens", "dim"), [([1], 64), ([7], 64), ([1, 4, 5, 13, 16], 64), ([3, 9], 128), ([3, 9], 40), ([2, 15, 33, 70], 64)])
def test_kernel_matches_gather_and_float64(dtype: torch.dtype, lens: list[int], dim: int) -> None:
    """64 and 128: the unrolled paths (AVX512-BF16 for bfloat16 where the CPU has it); 40: generic."""
    q, k_cache, v_cache, gathered, kernel = _case(dtype, lens, dim)
    scale = dim**-0.5
    got = _decode_attention(q, k_cache, v_cache, kernel, scale, kernel=True)
    plain = _decode_attention(q, k_cache, v_cache, gathered, scale)
    exact_batch = DecodeBatch(gathered.block_tables, gathered.bias.double() if gathered.bias is not None else None)
    exact = _decode_attention(q.double(), k_cache.double(), v_cache.double(), exact_batch, scale)
    # the PyTorch path given the kernel's batch (lengths, no bias) masks the same way
    torch.testing.assert_close(_decode_attention(q, k_cache, v_cache, kernel, scale), plain, atol=0, rtol=0)
    assert got.dtype == dtype and got.shape == (len(lens), HEADS, dim)
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the output
    assert (got.double() - exact).abs().max().item() < tolerance
    if dtype == torch.bfloat16:  # never worse than the gather path, which rounds scores and probabilities to bf16
        assert (got.double() - exact).abs().max() <= (plain.double() - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 40])
def test_kernel_log_sum_exp_matches_float64(dtype: torch.dtype, dim: int) -> None:
    """paged_decode_lse: the same output as paged_decode, and each query head's log-sum-exp
    of its scaled scores (what a cascade merges the shared prefix's attention with)."""
    lens = [1, 4, 5, 13, 16]
    q, k_cache, v_cache, _, kernel = _case(dtype, lens, dim)
    scale = dim**-0.5
    out, lse = torch.ops.kvmesh.paged_decode_lse(q, k_cache, v_cache, kernel.block_tables, kernel.context_lens, scale)
    plain = torch.ops.kvmesh.paged_decode(q, k_cache, v_cache, kernel.block_tables, kernel.context_lens, scale)
    torch.testing.assert_close(out, plain, atol=0, rtol=0)
    assert lse.dtype == torch.float32 and lse.shape == (len(lens), HEADS)
    for seq, length in enumerate(lens):
        blocks = kernel.block_tables[seq]
        keys = k_cache[blocks].reshape(-1, KV_HEADS, dim)[:length].double()  # (length, kv_heads, dim)
        per_head = keys.repeat_interleave(HEADS // KV_HEADS, dim=1)  # (length, heads, dim)
        scores = torch.einsum("hd,thd->ht", q[seq].double(), per_head) * scale
        want = torch.logsumexp(scores, dim=-1)
        assert (lse[seq].double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4, 5, 8, 9])
def test_kernel_matches_float64_for_every_group_size(dtype: torch.dtype, group: int) -> None:
    """Group sizes 1-8 have kernels of their own (accumulators in registers); 9 is generic."""
    lens = [1, 5, 13, 16, 17]
    q, k_cache, v_cache, gathered, kernel = _case(dtype, lens, heads=group * KV_HEADS)
    scale = DIM**-0.5
    got = _decode_attention(q, k_cache, v_cache, kernel, scale, kernel=True)
    assert gathered.bias is not None
    exact = _decode_attention(
        q.double(), k_cache.double(), v_cache.double(), DecodeBatch(gathered.block_tables, gathered.bias.double()), scale
    )
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3
    assert (got.double() - exact).abs().max().item() < tolerance


def test_kernel_refuses_a_bad_shape() -> None:
    q, k_cache, v_cache, _, kernel = _case(torch.float32, [5])
    with pytest.raises(RuntimeError, match="paged_decode"):
        torch.ops.kvmesh.paged_decode(q.float(), k_cache, v_cache, kernel.block_tables.int(), kernel.context_lens, 1.0)


def test_kernel_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_kernel, "_state", None)
    monkeypatch.setenv(paged_kernel.DISABLE_ENV, "0")
    assert not paged_kernel.available()
    assert paged_kernel.last_failure == f"{paged_kernel.DISABLE_ENV}=0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_is_bit_identical_to_the_pytorch_path(dtype: torch.dtype) -> None:
    from kvmesh.engine.model.attention import AttentionMetadata, write_kv
    from kvmesh.engine.model.llama import RotaryEmbedding

    gen = torch.Generator().manual_seed(3)
    tokens, num_blocks = 5, 6
    rotary = RotaryEmbedding(DIM, 64, 10000.0, dtype, torch.device("cpu"))
    cos, sin = rotary.tables(torch.tensor([0, 3, 17, 40, 63]))
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(dtype)
    slots = torch.tensor([0, 5, 2, 2, 4]), torch.tensor([0, 3, 1, 2, 0])
    meta = AttentionMetadata(slots[0], slots[1], 0, None, [])
    results = []
    for fused in (False, True):
        pool = torch.zeros(num_blocks, LAYERS, 2, BLOCK, KV_HEADS, DIM, dtype=dtype)
        k_cache, v_cache = pool[:, 2, 0], pool[:, 2, 1]
        flat = qkv.clone()
        qk = flat[:, : (HEADS + KV_HEADS) * DIM].view(tokens, HEADS + KV_HEADS, DIM)
        v = flat[:, (HEADS + KV_HEADS) * DIM :].view(tokens, KV_HEADS, DIM)
        if fused:
            torch.ops.kvmesh.rope_store(qk, v, cos, sin, k_cache, v_cache, slots[0], slots[1], HEADS)
        else:
            qk = rotary.apply(qk, cos, sin)
            write_kv(k_cache, v_cache, qk[:, HEADS:], v, meta)
        results.append((qk.clone(), pool))
    torch.testing.assert_close(results[1][0], results[0][0], atol=0, rtol=0)
    torch.testing.assert_close(results[1][1], results[0][1], atol=0, rtol=0)
    assert results[1][1].abs().sum() > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_greedy_tokens_with_the_kernels_on_and_off(tiny_model_dir, dtype: str) -> None:
    """Batched, ragged greedy decoding through the engine with the compiled ops forced on and
    off: float32 tokens identical; bfloat16 the defaults (kernel on) run and finish. Both dtypes
    run the kernel by default."""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype=dtype, block_size=4, num_blocks=128, enable_prefix_caching=False))
    assert engine.model.fused_rope and engine.model.paged_kernel
    prompts = [[5 + i for i in range(n)] for n in (3, 9, 14)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = []
    for flag in (True, False):
        engine.model.paged_kernel = engine.model.fused_rope = flag
        runs.append([out.new_token_ids for out in engine.generate(prompts, params)])
    assert all(len(tokens) == 12 for tokens in runs[0])
    if dtype == "float32":
        assert runs[0] == runs[1]


_AVX2_CHECK = """
import sys, torch
torch.ops.load_library(sys.argv[1])
from tests.engine.test_paged_kernel import _case
from kvmesh.engine.model.attention import DecodeBatch, _decode_attention
worst = 0.0
for lens, dim in (([1], 64), ([1, 4, 5, 13, 16], 64), ([3, 9], 128), ([3, 9], 40)):
    q, k_cache, v_cache, gathered, kernel = _case(torch.float32, lens, dim)
    got = torch.ops.kvmesh.paged_decode(q, k_cache, v_cache, kernel.block_tables, kernel.context_lens, dim**-0.5)
    exact = _decode_attention(q.double(), k_cache.double(), v_cache.double(),
                              DecodeBatch(gathered.block_tables, gathered.bias.double()), dim**-0.5)
    worst = max(worst, (got.double() - exact).abs().max().item())
import torch.nn.functional as F
def relative(got, want):  # the largest error over the largest magnitude
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
torch.manual_seed(0)
x, w = torch.randn(300, 96) * 3, torch.randn(96)
norm_error = relative(torch.ops.kvmesh.rms_norm(x, w, 1e-5), F.rms_norm(x, (96,), w, 1e-5))
gate_up = torch.randn(300, 320) * 4
silu_error = relative(torch.ops.kvmesh.silu_mul(gate_up, 160), F.silu(gate_up[:, :160]) * gate_up[:, 160:])
w, x, b = torch.randn(963, 577), torch.randn(3, 577), torch.randn(963)
linear_error = relative(torch.ops.kvmesh.small_linear(x, w, b), F.linear(x.double(), w.double(), b.double()))
packed_error = 0.0  # the packed float32 kernel: 16-output groups, passes of six rows, chains, masked tails
w, b = torch.randn(37, 577), torch.randn(37)
for rows in (1, 3, 6, 7, 13, 32):
    x = torch.randn(rows, 577)
    got = torch.ops.kvmesh.f32_packed_linear(x, torch.ops.kvmesh.f32_pack(w), 37, b)
    packed_error = max(packed_error, relative(got, F.linear(x.double(), w.double(), b.double())))
refused = []
for dtype in (torch.bfloat16, torch.float32):
    x = torch.zeros(2, 2, 64, dtype=dtype)
    try:
        torch.ops.kvmesh.prefill_attention(x, x[:, :1], x[:, :1], 0.125)
        refused.append(False)
    except RuntimeError as exc:
        refused.append("no kernel" in str(exc))
print(worst, norm_error, silu_error, linear_error, packed_error, torch.ops.kvmesh.small_linear_available("bfloat16"),
      torch.ops.kvmesh.small_linear_available("float32"), torch.ops.kvmesh.amx_available(),
      torch.ops.kvmesh.prefill_attention_built("bfloat16") or torch.ops.kvmesh.prefill_attention_built("float32"), all(refused),
      torch.ops.kvmesh.f32_packed_linear_lanes())
"""


@pytest.mark.skipif("avx2" not in paged_kernel._cpu_flags().split(), reason="x86-64 with AVX2 only")
def test_the_avx2_build_matches_float64(tmp_path) -> None:
    """The kernel as an AVX2 machine without AVX-512 builds it (8-float vectors, the AVX
    horizontal sum), loaded in a process of its own, against float64."""
    import subprocess
    import sys
    from pathlib import Path

    built = paged_kernel.build(tmp_path, march="x86-64-v3")
    assert built is not None, paged_kernel.last_failure
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", _AVX2_CHECK, str(built)], capture_output=True, text=True, cwd=root, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    worst, norm_error, silu_error, linear_error, packed_error, small_bf16, small_f32, tiles, prefill, refused, lanes = result.stdout.split()
    assert float(worst) < 1e-6
    assert float(norm_error) < 1e-6 and float(silu_error) < 1e-6  # the fused elementwise ops, 8-float vectors (relative)
    # the small-batch linear: float32 with AVX2 + FMA (8-float vectors, a masked tail); no bfloat16
    assert float(linear_error) < 1e-6 and (small_bf16, small_f32) == ("False", "True")
    # the packed float32 linear too (8-float vectors, AVX2 masks): float32 sums of 577 products,
    # a few units in the last place of sqrt(577) terms at most
    assert float(packed_error) < 4 * 577**0.5 * 2.0**-24 and lanes == "8"
    assert tiles == "False"  # no AMX tile kernel either
    assert (prefill, refused) == ("False", "True")  # nor the prefill attention (either dtype): refused by name
