"""The packed float32 linear kernel (csrc/f32_packed_linear.cpp) against float64 and oneDNN, the
layers' routing to it, the plan that gives it, and the model with it on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.engine.model import paged_kernel, small_batch
from kvmesh.engine.model.linear import Linear
from kvmesh.engine.model.weights import LayerWeights, ModelWeights


def _kernel_here() -> bool:
    return paged_kernel.compiler() is not None and paged_kernel.available() and small_batch.f32_packed_available()


packed = pytest.mark.skipif(not _kernel_here(), reason="no AVX-512 or AVX2 with FMA here (or no compiled kernels)")


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    got = torch.ops.kvmesh.f32_packed_linear(x, torch.ops.kvmesh.f32_pack(weight), weight.shape[0], bias)
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], weight.shape[0])
    exact = F.linear(x.double(), weight.double(), bias.double() if bias is not None else None)
    # float32 sums of K products in another order than oneDNN's: a few units in the last place
    # of the largest term's magnitude, growing with K
    scale = (x.double().abs() @ weight.double().abs().T).max().item()
    assert (got.double() - exact).abs().max().item() <= 4 * weight.shape[1] ** 0.5 * 2.0**-24 * scale + 1e-30


@packed
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "bias"),
    [
        (5, 960, 576, False),  # the default model's shapes
        (10, 3072, 576, True),
        (12, 576, 1536, False),
        (13, 576, 576, False),  # past a pass: even passes, the group's weight in cache
        (32, 64, 576, True),
        (1, 5, 40, True),  # outputs not whole groups: zero padding, masked stores
        (2, 50, 37, False),  # a few rows: chains of sums
        (4, 33, 31, True),
        (3, 17, 1, False),
        (2, 50, 38, True),  # chains with k left over; a last group 18 wide
        (3, 45, 77, True),
    ],
)
def test_f32_packed_linear_against_float64(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    _check(x, weight, b)


@packed
def test_f32_packed_linear_reads_strided_rows_and_refuses_what_it_cannot_compute() -> None:
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(96, 63, generator=gen)
    wide = torch.randn(12, 200, generator=gen)
    _check(wide[:, 3:66], weight, None)  # rows 200 apart, not aligned
    wide[:, 66:] = float("nan")  # nothing past K is read
    _check(wide[:, 3:66], weight, None)
    pack = torch.ops.kvmesh.f32_pack(weight)
    assert torch.ops.kvmesh.f32_packed_linear(torch.empty(0, 63), pack, 96, None).shape == (0, 96)
    x = torch.randn(6, 63)
    with pytest.raises(RuntimeError, match="is not of a"):
        torch.ops.kvmesh.f32_packed_linear(x, pack, 200, None)
    with pytest.raises(RuntimeError, match="is not of a"):
        torch.ops.kvmesh.f32_packed_linear(torch.randn(6, 64), pack, 96, None)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvmesh.f32_packed_linear(x.bfloat16(), pack, 96, None)
    with pytest.raises(RuntimeError, match="rows contiguous"):
        torch.ops.kvmesh.f32_packed_linear(torch.randn(63, 6).t(), pack, 96, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.kvmesh.f32_packed_linear(x, pack, 96, torch.zeros(3))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvmesh.f32_pack(weight.bfloat16())


@packed
def test_a_float32_linear_sends_rows_past_small_rows_to_the_packed_kernel() -> None:
    weight = torch.randn(64, 96)
    small, most = small_batch.SMALL_ROWS[torch.float32], small_batch.F32_PACKED_ROWS
    linear = Linear(weight, small_rows=small, tile_rows=most, tile_kernel="f32")  # as the plan sets it
    plain = Linear(weight)
    pack = torch.ops.kvmesh.f32_pack(weight)
    x = torch.randn(small, 96)
    torch.testing.assert_close(linear(x), torch.ops.kvmesh.small_linear(x, weight, None), atol=0, rtol=0)
    for rows in (small + 1, 17, most):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(linear(x), torch.ops.kvmesh.f32_packed_linear(x, pack, 64, None), atol=0, rtol=0)
    x = torch.randn(most + 1, 96)
    torch.testing.assert_close(linear(x), plain(x), atol=0, rtol=0)


def _weights() -> ModelWeights:
    def t(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.float32)

    layer = LayerWeights(t(8), t(24, 8), None, t(8, 8), t(8), t(32, 8), t(8, 16))  # 2,560 bytes of linears
    embed = t(50, 8)  # 1,600 bytes
    return ModelWeights(embed=embed, layers=[layer, layer], norm=t(8), lm_head=embed)


@pytest.mark.skipif(paged_kernel.compiler() is None or not paged_kernel.available(), reason="no compiled kernels")
def test_the_plan_gives_float32_the_packed_kernel(monkeypatch) -> None:
    """The small-batch kernel to SMALL_ROWS, the packed kernel past it, on any CPU that builds it
    (AMX or not: the tiles are bfloat16's); its copy beside the plain one within the limit, else
    first. (The kernels are pretended, so that this runs on any CPU that builds the library.)"""
    monkeypatch.setattr(torch.ops.kvmesh, "small_linear_available", lambda name: True, raising=False)
    monkeypatch.setattr(small_batch, "f32_packed_available", lambda: True)
    monkeypatch.setattr(small_batch, "f32_packed_lanes", lambda: 16)  # built for AVX-512
    small, most = small_batch.SMALL_ROWS[torch.float32], small_batch.F32_PACKED_ROWS
    for amx in (False, True):
        monkeypatch.setattr(small_batch, "cpu_has_amx", lambda amx=amx: amx)
        plan = small_batch.plan(_weights(), torch.float32, compiled=True, prepacked=True)
        assert (plan.layer_rows, plan.lm_head_rows, plan.tile_rows, plan.tile_kernel) == (small, small, most, "f32")
        assert f"packed weights for float32 fused multiply-adds for {small + 1}-{most} rows" in plan.why
    monkeypatch.setattr(small_batch, "PLAIN_COPY_LIMIT", 8000)  # the packed copy (6,720 bytes) fits, not both (11,840)
    plan = small_batch.plan(_weights(), torch.float32, compiled=True, prepacked=True)
    assert (plan.layer_rows, plan.lm_head_rows, plan.tile_rows, plan.tile_kernel) == (0, small, most, "f32")
    monkeypatch.setattr(small_batch, "f32_packed_available", lambda: False)
    plan = small_batch.plan(_weights(), torch.float32, compiled=True, prepacked=True)
    assert plan.tile_rows == 0 and plan.tile_kernel == ""


@pytest.mark.skipif(paged_kernel.compiler() is None or not paged_kernel.available(), reason="no compiled kernels")
def test_the_plan_gives_float32_every_row_to_the_packed_kernel_built_for_avx2(monkeypatch) -> None:
    """Built for AVX2 (8-float vectors), the packed kernel takes float32 from one row to
    F32_PACKED_ROWS_AVX2 and no plain copies are kept; where its copy does not fit, the
    small-batch kernel's rows again."""
    monkeypatch.setattr(torch.ops.kvmesh, "small_linear_available", lambda name: True, raising=False)
    monkeypatch.setattr(small_batch, "f32_packed_available", lambda: True)
    monkeypatch.setattr(small_batch, "f32_packed_lanes", lambda: 8)
    most = small_batch.F32_PACKED_ROWS_AVX2
    plan = small_batch.plan(_weights(), torch.float32, compiled=True, prepacked=True)
    assert (plan.layer_rows, plan.lm_head_rows, plan.tile_rows, plan.tile_kernel) == (0, 0, most, "f32")
    assert plan.why == f"on: packed weights for float32 fused multiply-adds for 1-{most} rows (0 MiB)"
    monkeypatch.setattr(small_batch, "PLAIN_COPY_LIMIT", 6000)  # the packed copy (6,720 bytes) does not fit; plain (5,120) does
    plan = small_batch.plan(_weights(), torch.float32, compiled=True, prepacked=True)
    small = small_batch.SMALL_ROWS[torch.float32]
    assert (plan.layer_rows, plan.lm_head_rows, plan.tile_rows, plan.tile_kernel) == (small, small, 0, "")
    assert plan.why.startswith(f"on: small-batch kernel for up to {small} rows (keeping 0 MiB of plain weights")


@packed
def test_the_packed_kernel_built_here_takes_what_the_plan_gives_it() -> None:
    """The lanes the library reports are the CPU's widest vectors it was built for."""
    from kvmesh.machine import cpu_flags

    assert small_batch.f32_packed_lanes() == (16 if "avx512f" in cpu_flags().split() else 8)


@packed
def test_float32_greedy_tokens_with_the_packed_kernel_on_and_off(tiny_model_dir) -> None:
    """float32, two to twelve sequences decoding together (the packed kernel's rows): the same
    greedy tokens with it as with oneDNN, and nothing left in the pool."""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=4, num_blocks=256))
    assert engine.model.tile_linear
    most = small_batch.f32_packed_rows(small_batch.f32_packed_lanes())
    assert all(linear.tile_rows == most and linear.tiles is not None for linear in engine.model.linears())
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [[5 + i, 17 + 2 * i, 40 + i] for i in range(12)]
    runs = []
    for on in (True, False):
        engine.model.tile_linear = on
        runs.append([out.new_token_ids for count in (5, 12) for out in engine.generate(prompts[:count], params)])
    assert runs[0] == runs[1]
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks


@pytest.mark.parametrize(
    "case", ["no compiled kernels", "bfloat16 without a tile kernel", "bfloat16 copies past the limit", "float32 copies past the limit"]
)
def test_a_model_builds_and_runs_where_the_plan_gives_no_tile_kernel(tiny_model_dir, monkeypatch, case: str) -> None:
    """Every plan without a tile kernel (tile_rows 0, tile_kernel "") still builds its layers and
    decodes; without the packed copy, bfloat16 on a CPU without AMX keeps the small-batch kernel's
    eight rows. (Once, a layer looked its tile ops up even with none: every such model failed to load.)"""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams

    dtype = "float32" if case.startswith("float32") else "bfloat16"
    if case == "no compiled kernels":
        monkeypatch.setattr(paged_kernel, "available", lambda: False)
    elif not (paged_kernel.compiler() is not None and paged_kernel.available()):
        pytest.skip("no compiled kernels")
    elif case == "bfloat16 without a tile kernel":
        monkeypatch.setattr(small_batch, "vnni_available", lambda: False)
        monkeypatch.setattr(small_batch, "amx_available", lambda: False)
    else:
        monkeypatch.setattr(small_batch, "PLAIN_COPY_LIMIT", 1)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype=dtype, block_size=4, num_blocks=128))
    assert not engine.model.tile_linear
    assert all(linear.tiles is None for linear in engine.model.linears())
    if case == "bfloat16 copies past the limit" and torch.ops.kvmesh.small_linear_available("bfloat16"):
        if not small_batch.cpu_has_amx():
            assert engine.model.lm_head.small_rows == small_batch.SMALL_ROWS_BF16_UNPACKED
    outs = engine.generate([[5, 17, 40], [6, 19, 41, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(out.new_token_ids) for out in outs] == [4, 4]
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks
