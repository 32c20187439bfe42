"""The AMX tile linear kernel (csrc/amx_linear.cpp) against float64 and oneDNN, the layers'
routing to it, the plan that gives the layers its copies, and the model with it on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.engine.model import paged_kernel, small_batch
from kvmesh.engine.model.linear import Linear
from kvmesh.engine.model.weights import LayerWeights, ModelWeights
from tests.engine.test_fused_ops import logprob_gap


def _tiles_here() -> bool:
    return paged_kernel.compiler() is not None and paged_kernel.available() and small_batch.amx_available()


amx = pytest.mark.skipif(not _tiles_here(), reason="no AMX-BF16 on this CPU (or no compiled kernels)")


def check_tile_kernel(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``torch.ops.kvmesh.<op>`` on amx_pack's tiles of ``weight`` (bfloat16) as accurate as
    oneDNN against float64, and equal to it almost everywhere."""
    got = getattr(torch.ops.kvmesh, op)(x, torch.ops.kvmesh.amx_pack(weight), weight.shape[0], bias)
    assert got.dtype == torch.bfloat16 and got.shape == (x.shape[0], weight.shape[0])
    exact = F.linear(x.double(), weight.double(), bias.double() if bias is not None else None)
    onednn = F.linear(x, weight, bias)
    ulp = exact.abs() * 2.0**-8 + 1e-6  # half a unit: each output is its float32 sum rounded once
    assert ((got.double() - exact).abs() <= (onednn.double() - exact).abs() + 2 * ulp).all()
    assert (got == onednn).float().mean().item() > 0.99


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_tile_kernel("amx_linear", x, weight, bias)


@amx
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "bias"),
    [
        (1, 960, 576, False),  # the default model's shapes: whole tiles, x read where it lies
        (8, 3072, 576, True),
        (32, 576, 1536, False),
        (3, 5, 40, True),  # outputs and inputs not whole tiles: zero padding
        (16, 50, 96, False),
        (17, 130, 160, True),  # 17 rows: a second tile of x with one real row, padded to 16
        (33, 64, 576, False),  # more than 32 rows: 32 at a time with the weight tiles in cache
        (64, 96, 576, True),
        (70, 33, 100, False),
    ],
)
def test_amx_linear_as_accurate_as_onednn(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    _check(x, weight, b)


@amx
def test_amx_linear_reads_strided_rows_and_empty_batches() -> None:
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    wide = torch.randn(12, 200, generator=gen).bfloat16()
    _check(wide[:, 40:104], weight, None)  # rows 200 apart, as a slice of a wider tensor
    _check(wide[:, 3:67], weight, None)  # and not 64-byte aligned
    empty = torch.ops.kvmesh.amx_linear(torch.empty(0, 64, dtype=torch.bfloat16), torch.ops.kvmesh.amx_pack(weight), 96, None)
    assert empty.shape == (0, 96)


@amx
def test_amx_linear_refuses_what_it_cannot_compute() -> None:
    weight = torch.randn(64, 96).bfloat16()
    tiles = torch.ops.kvmesh.amx_pack(weight)
    x = torch.randn(4, 96).bfloat16()
    with pytest.raises(RuntimeError, match="are not of a"):
        torch.ops.kvmesh.amx_linear(x, tiles, 200, None)  # tiles of another weight
    with pytest.raises(RuntimeError, match="are not of a"):
        torch.ops.kvmesh.amx_linear(torch.randn(4, 200).bfloat16(), tiles, 64, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.kvmesh.amx_linear(x.float(), tiles, 64, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.kvmesh.amx_linear(x, tiles, 64, torch.zeros(3).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.kvmesh.amx_pack(weight.float())


@amx
def test_a_linear_sends_tens_of_rows_to_the_tiles() -> None:
    weight = torch.randn(64, 96).bfloat16()
    linear = Linear(weight, small_rows=2, tile_rows=small_batch.TILE_ROWS)  # as the plan sets it
    plain = Linear(weight)
    tiles = torch.ops.kvmesh.amx_pack(weight)
    for rows in (1, 2):
        x = torch.randn(rows, 96).bfloat16()
        torch.testing.assert_close(linear(x), torch.ops.kvmesh.small_linear(x, weight, None), atol=0, rtol=0)
    for rows in (3, 17, small_batch.TILE_ROWS):
        x = torch.randn(rows, 96).bfloat16()
        torch.testing.assert_close(linear(x), torch.ops.kvmesh.amx_linear(x, tiles, 64, None), atol=0, rtol=0)
    x = torch.randn(small_batch.TILE_ROWS + 1, 96).bfloat16()
    torch.testing.assert_close(linear(x), plain(x), atol=0, rtol=0)


def _weights(dtype: torch.dtype) -> ModelWeights:
    def t(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype)

    layer = LayerWeights(t(8), t(24, 8), None, t(8, 8), t(8), t(32, 8), t(8, 16))  # 1,152 bytes of linears in bf16
    embed = t(50, 8)  # 800 bytes
    return ModelWeights(embed=embed, layers=[layer, layer], norm=t(8), lm_head=embed)


@pytest.mark.skipif(paged_kernel.compiler() is None or not paged_kernel.available(), reason="no compiled kernels")
def test_the_plan_gives_the_tiles_their_copies_within_the_limit(monkeypatch) -> None:
    """Plain copies (2,304 bytes for two layers) and tiles (those and the output layer's 800)."""
    monkeypatch.setattr(small_batch, "amx_available", lambda: True)
    monkeypatch.setattr(small_batch, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(torch.ops.kvmesh, "small_linear_available", lambda name: True, raising=False)
    rows, tiles = small_batch.SMALL_ROWS[torch.bfloat16], small_batch.TILE_ROWS
    plan = small_batch.plan(_weights(torch.bfloat16), torch.bfloat16, compiled=True, prepacked=True)
    assert (plan.layer_rows, plan.lm_head_rows, plan.tile_rows) == (rows, rows, tiles)
    assert f"AMX tiles for {rows + 1}-{tiles} rows" in plan.why
    monkeypatch.setattr(small_batch, "PLAIN_COPY_LIMIT", 4000)  # the tiles fit, not both copies: the tiles first
    plan = small_batch.plan(_weights(torch.bfloat16), torch.bfloat16, compiled=True, prepacked=True)
    assert (plan.layer_rows, plan.lm_head_rows, plan.tile_rows) == (0, rows, tiles)
    assert plan.why.startswith(f"on: AMX tiles for 1-{tiles} rows")
    monkeypatch.setattr(small_batch, "PLAIN_COPY_LIMIT", 3000)  # not the tiles; the plain copies do
    plan = small_batch.plan(_weights(torch.bfloat16), torch.bfloat16, compiled=True, prepacked=True)
    assert (plan.layer_rows, plan.lm_head_rows, plan.tile_rows) == (rows, rows, 0)
    assert "no AMX tiles of the weights would take" in plan.why
    plan = small_batch.plan(_weights(torch.float32), torch.float32, compiled=True, prepacked=True)
    assert plan.tile_kernel != "amx"  # bfloat16 only
    monkeypatch.setattr(small_batch, "amx_available", lambda: False)
    monkeypatch.setattr(small_batch, "vnni_available", lambda: False)  # (test_vnni_linear.py's)
    plan = small_batch.plan(_weights(torch.bfloat16), torch.bfloat16, compiled=True, prepacked=True)
    assert plan.tile_rows == 0 and "AMX" not in plan.why


@amx
def test_the_model_with_the_tile_kernel_on_and_off(tiny_model_dir) -> None:
    """bfloat16, three to twelve sequences decoding together (the tiles' rows): every
    sequence's log-probabilities are as close to float32's with the tiles as with oneDNN,
    and nothing is left in the pool."""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams

    config = dict(model=str(tiny_model_dir), block_size=4, num_blocks=256)
    reference = LLMEngine(EngineConfig(dtype="float32", **config))
    engine = LLMEngine(EngineConfig(dtype="bfloat16", **config))
    assert engine.model.tile_linear
    assert all(linear.tile_rows == small_batch.TILE_ROWS and linear.tiles is not None for linear in engine.model.linears())
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=8)
    prompts = [[5 + i, 17 + 2 * i, 40 + i] for i in range(12)]

    def logprobs(eng: LLMEngine, count: int) -> list[dict[int, float]]:
        return [dict(out.logprobs[1].top) for out in eng.generate(prompts[:count], params)]  # a decode step's

    errors = {}
    for on in (True, False):
        engine.model.tile_linear = on
        worst = 0.0
        for count in (3, 12):
            for want, got in zip(logprobs(reference, count), logprobs(engine, count), strict=True):
                worst = max(worst, logprob_gap(want, got))
        errors[on] = worst
    assert not engine.model.tile_linear
    assert errors[True] <= 2 * errors[False] + 0.02, errors
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks
