"""The packed AVX512-BF16 linear kernel (csrc/vnni_linear.cpp, reading amx_pack's layout)
against float64 and oneDNN, the layers' routing to it, the plan that gives it on a CPU without
AMX, and the model with it on and off."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.model import paged_kernel, small_batch
from kvmesh.engine.model.linear import Linear
from kvmesh.engine.model.weights import LayerWeights, ModelWeights
from tests.engine.test_amx_linear import check_tile_kernel
from tests.engine.test_fused_ops import logprob_gap


def _kernel_here() -> bool:
    return paged_kernel.compiler() is not None and paged_kernel.available() and small_batch.vnni_available()


vnni = pytest.mark.skipif(not _kernel_here(), reason="no AVX512-BF16 on this CPU (or no compiled kernels)")


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_tile_kernel("vnni_linear", x, weight, bias)


@vnni
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "bias"),
    [
        (2, 960, 576, False),  # the default model's shapes; two rows: four chains of sums
        (4, 576, 576, True),  # four: two chains
        (10, 3072, 576, True),
        (12, 576, 1536, False),  # twelve rows: one pass, 24 sums in registers
        (13, 576, 576, False),  # thirteen: twelve, then one more with the weight in cache
        (32, 64, 576, True),
        (1, 5, 40, True),  # outputs and inputs not whole tiles: zero padding, masked stores
        (7, 50, 37, False),  # an odd K: the last value is a pair with a zero
        (25, 33, 31, True),  # odd K inside the first k tile, one output past 32
        (3, 17, 1, False),
        (2, 50, 38, True),  # four chains with pairs left over in the last k tile; a last group 18 wide
        (3, 45, 77, True),  # two chains, an odd K; a last group 13 wide
    ],
)
def test_vnni_linear_as_accurate_as_onednn(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    _check(x, weight, b)


@vnni
def test_vnni_linear_reads_strided_rows_and_never_past_k() -> None:
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(96, 63, generator=gen).bfloat16()
    wide = torch.randn(12, 200, generator=gen).bfloat16()
    _check(wide[:, 40:103], weight, None)  # rows 200 apart, as a slice of a wider tensor
    _check(wide[:, 3:66], weight, None)  # and not aligned
    # What lies past K in a row must not count, even a NaN (the padded weights are zero; 0 x NaN is NaN).
    wide[:, 66:] = float("nan")
    _check(wide[:, 3:66], weight, None)
    empty = torch.ops.kvmesh.vnni_linear(torch.empty(0, 63, dtype=torch.bfloat16), torch.ops.kvmesh.amx_pack(weight), 96, None)
    assert empty.shape == (0, 96)


@vnni
def test_vnni_linear_refuses_what_it_cannot_compute() -> None:
    weight = torch.randn(64, 96).bfloat16()
    tiles = torch.ops.kvmesh.amx_pack(weight)
    x = torch.randn(6, 96).bfloat16()
    with pytest.raises(RuntimeError, match="are not of a"):
        torch.ops.kvmesh.vnni_linear(x, tiles, 200, None)  # tiles of another weight
    with pytest.raises(RuntimeError, match="are not of a"):
        torch.ops.kvmesh.vnni_linear(torch.randn(6, 200).bfloat16(), tiles, 64, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.kvmesh.vnni_linear(x.float(), tiles, 64, None)
    with pytest.raises(RuntimeError, match="rows contiguous"):
        torch.ops.kvmesh.vnni_linear(torch.randn(96, 6).bfloat16().t(), tiles, 64, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.kvmesh.vnni_linear(x, tiles, 64, torch.zeros(3).bfloat16())


@vnni
def test_a_linear_sends_two_to_32_rows_to_the_packed_kernel() -> None:
    weight = torch.randn(64, 96).bfloat16()
    one = small_batch.SMALL_ROWS_BF16_WITHOUT_AMX
    linear = Linear(weight, small_rows=one, tile_rows=small_batch.VNNI_ROWS, tile_kernel="vnni")  # as the plan sets it
    plain = Linear(weight)
    tiles = torch.ops.kvmesh.amx_pack(weight)
    x = torch.randn(one, 96).bfloat16()
    torch.testing.assert_close(linear(x), torch.ops.kvmesh.small_linear(x, weight, None), atol=0, rtol=0)
    for rows in (one + 1, 5, 17, small_batch.VNNI_ROWS):
        x = torch.randn(rows, 96).bfloat16()
        torch.testing.assert_close(linear(x), torch.ops.kvmesh.vnni_linear(x, tiles, 64, None), atol=0, rtol=0)
    x = torch.randn(small_batch.VNNI_ROWS + 1, 96).bfloat16()
    torch.testing.assert_close(linear(x), plain(x), atol=0, rtol=0)


def _weights() -> ModelWeights:
    def t(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.bfloat16)

    layer = LayerWeights(t(8), t(24, 8), None, t(8, 8), t(8), t(32, 8), t(8, 16))  # 1,152 bytes of linears
    embed = t(50, 8)  # 800 bytes
    return ModelWeights(embed=embed, layers=[layer, layer], norm=t(8), lm_head=embed)


@pytest.mark.skipif(paged_kernel.compiler() is None or not paged_kernel.available(), reason="no compiled kernels")
def test_the_plan_gives_the_packed_kernel_its_rows_on_a_cpu_without_amx(monkeypatch) -> None:
    """Without AMX: the small-batch kernel for one row, the packed kernel for 2-32 (its copy
    beside the plain one within the limit, else first); a CPU with AMX but without kvmesh's tile
    kernel leaves those rows to oneDNN (which has the tiles). The CPU and its kernels are
    pretended, so that this runs on any CPU that builds the library."""
    monkeypatch.setattr(torch.ops.kvmesh, "small_linear_available", lambda name: True, raising=False)
    monkeypatch.setattr(small_batch, "vnni_available", lambda: True)
    monkeypatch.setattr(small_batch, "amx_available", lambda: False)
    monkeypatch.setattr(small_batch, "cpu_has_amx", lambda: False)
    one, most = small_batch.SMALL_ROWS_BF16_WITHOUT_AMX, small_batch.VNNI_ROWS
    plan = small_batch.plan(_weights(), torch.bfloat16, compiled=True, prepacked=True)
    assert (plan.layer_rows, plan.lm_head_rows, plan.tile_rows, plan.tile_kernel) == (one, one, most, "vnni")
    assert "small-batch kernel for one row" in plan.why
    assert f"packed weights for AVX512-BF16 dot products for {one + 1}-{most} rows" in plan.why
    monkeypatch.setattr(small_batch, "PLAIN_COPY_LIMIT", 4000)  # the packed copy fits, not both: it first
    plan = small_batch.plan(_weights(), torch.bfloat16, compiled=True, prepacked=True)
    assert (plan.layer_rows, plan.lm_head_rows, plan.tile_rows, plan.tile_kernel) == (0, one, most, "vnni")
    monkeypatch.setattr(small_batch, "PLAIN_COPY_LIMIT", 3000)  # not the packed copy; the plain one: eight rows
    plan = small_batch.plan(_weights(), torch.bfloat16, compiled=True, prepacked=True)
    unpacked = small_batch.SMALL_ROWS_BF16_UNPACKED
    assert (plan.layer_rows, plan.lm_head_rows, plan.tile_rows, plan.tile_kernel) == (unpacked, unpacked, 0, "")
    assert f"small-batch kernel for up to {unpacked} rows" in plan.why
    monkeypatch.setattr(small_batch, "PLAIN_COPY_LIMIT", 2**30)
    plan = small_batch.plan(_weights(), torch.float32, compiled=True, prepacked=True)
    assert plan.tile_kernel != "vnni"  # bfloat16 only (float32 has a packed kernel of its own)
    monkeypatch.setattr(small_batch, "cpu_has_amx", lambda: True)
    plan = small_batch.plan(_weights(), torch.bfloat16, compiled=True, prepacked=True)
    assert (plan.layer_rows, plan.tile_rows, plan.tile_kernel) == (small_batch.SMALL_ROWS[torch.bfloat16], 0, "")


@vnni
def test_the_model_with_the_packed_kernel_on_and_off(tiny_model_dir) -> None:
    """bfloat16, two to twelve sequences decoding together (the packed kernel's rows): every
    sequence's log-probabilities are as close to float32's with it as with oneDNN, and nothing
    is left in the pool."""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams

    config = dict(model=str(tiny_model_dir), block_size=4, num_blocks=256)
    reference = LLMEngine(EngineConfig(dtype="float32", **config))
    engine = LLMEngine(EngineConfig(dtype="bfloat16", **config))
    if small_batch.cpu_has_amx():
        pytest.skip("this CPU has AMX: the AMX tile kernel or oneDNN takes these rows")
    assert engine.model.tile_linear
    assert all(linear.tile_rows == small_batch.VNNI_ROWS and linear.tiles is not None for linear in engine.model.linears())
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=8)
    prompts = [[5 + i, 17 + 2 * i, 40 + i] for i in range(12)]

    def logprobs(eng: LLMEngine, count: int) -> list[dict[int, float]]:
        return [dict(out.logprobs[1].top) for out in eng.generate(prompts[:count], params)]  # a decode step's

    errors = {}
    for on in (True, False):
        engine.model.tile_linear = on
        worst = 0.0
        for count in (2, 5, 12):
            for want, got in zip(logprobs(reference, count), logprobs(engine, count), strict=True):
                worst = max(worst, logprob_gap(want, got))
        errors[on] = worst
    assert not engine.model.tile_linear
    assert errors[True] <= 2 * errors[False] + 0.02, errors
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks
