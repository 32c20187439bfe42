"""The compiled elementwise ops (csrc/fused_ops.cpp) and the small-batch linear kernel
(csrc/small_linear.cpp) against PyTorch, and the model with them on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.engine.model import paged_kernel, small_batch
from kvmesh.engine.model.linear import Linear
from kvmesh.engine.model.weights import LayerWeights, ModelWeights
from kvmesh.machine import cpu_has_amx

pytestmark = pytest.mark.skipif(paged_kernel.compiler() is None, reason="no C++ compiler: the PyTorch ops run")

HIDDEN, INTER, EPS = 96, 160, 1e-5
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert paged_kernel.available(), paged_kernel.last_failure


def _rows(tokens: int, width: int, dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    """(tokens, width) with rows one element apart in memory (a strided view, as a slice of qkv is)."""
    wide = torch.randn(tokens, width + 8, generator=torch.Generator().manual_seed(seed)) * scale
    return wide.to(dtype)[:, 3 : 3 + width]


def _assert_as_pytorch(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: within a few units in the last place (the sum's order differs); half types:
    almost every element bit-identical (the same roundings), the rest one unit apart."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    assert (got == want).float().mean().item() > 0.995
    ulp = 2.0 ** (-7 if want.dtype == torch.bfloat16 else -10)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * ulp + 1e-6).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 700])  # 700 rows: split over the thread pool
def test_rms_norm_and_the_residual_add_as_pytorch(dtype: torch.dtype, tokens: int) -> None:
    x = _rows(tokens, HIDDEN, dtype, 1)
    delta = _rows(tokens, HIDDEN, dtype, 2)
    weight = (torch.randn(HIDDEN, generator=torch.Generator().manual_seed(3)) + 1).to(dtype)
    _assert_as_pytorch(torch.ops.kvmesh.rms_norm(x, weight, EPS), F.rms_norm(x, (HIDDEN,), weight, EPS))

    residual = x.clone()
    normed = torch.ops.kvmesh.add_rms_norm(residual, delta, weight, EPS)
    torch.testing.assert_close(residual, x + delta, atol=0, rtol=0)  # in place, rounded as PyTorch's add
    _assert_as_pytorch(normed, F.rms_norm(x + delta, (HIDDEN,), weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_silu_mul_as_pytorch(dtype: torch.dtype, tokens: int) -> None:
    gate_up = _rows(tokens, 2 * INTER, dtype, 4, scale=4.0)
    want = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
    _assert_as_pytorch(torch.ops.kvmesh.silu_mul(gate_up, INTER), want)


def test_the_elementwise_ops_refuse_bad_input() -> None:
    x = torch.randn(2, HIDDEN)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.kvmesh.rms_norm(x, torch.randn(HIDDEN + 1), EPS)
    with pytest.raises(RuntimeError, match="differ"):
        torch.ops.kvmesh.add_rms_norm(x, torch.randn(3, HIDDEN), torch.randn(HIDDEN), EPS)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        torch.ops.kvmesh.rms_norm(x.double(), torch.randn(HIDDEN).double(), EPS)
    with pytest.raises(RuntimeError, match="2 \\* width"):
        torch.ops.kvmesh.silu_mul(torch.randn(2, 10), 4)
    with pytest.raises(RuntimeError, match="rows contiguous"):
        torch.ops.kvmesh.rms_norm(x.t(), torch.randn(2), EPS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_with_the_fused_ops_on_and_off(tiny_model_dir, dtype: str) -> None:
    """float32: the same greedy tokens either way; bfloat16: both run and finish (a rounding
    one unit apart may break a near tie of the random tiny model)."""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype=dtype, block_size=4, num_blocks=128))
    assert engine.model.fused_elementwise
    prompts = [[5 + i for i in range(n)] for n in (3, 9, 14)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = []
    for flag in (True, False):
        engine.model.fused_elementwise = flag
        runs.append([out.new_token_ids for out in engine.generate(prompts, params)])
    assert all(len(tokens) == 12 for run in runs for tokens in run)
    if dtype == "float32":
        assert runs[0] == runs[1]
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks


def _small_linear(dtype: str) -> bool:
    return paged_kernel.available() and torch.ops.kvmesh.small_linear_available(dtype)


small_linear = pytest.mark.skipif(not _small_linear("bfloat16"), reason="no AVX512-BF16 on this CPU")


def logprob_gap(want: dict[int, float], got: dict[int, float]) -> float:
    """The largest difference between two top-k log-probability maps, over their common tokens."""
    common = want.keys() & got.keys()
    assert common
    return max(abs(got[t] - want[t]) for t in common)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "bias"),
    [(1, 96, 64, False), (2, 963, 577, True), (3, 5, 40, True), (5, 130, 160, False), (9, 64, 1536, False)],
)
def test_small_linear_as_accurate_as_onednn(dtype: torch.dtype, rows: int, out_features: int, in_features: int, bias: bool) -> None:
    """Tails of every kind: rows not a multiple of the four a vector serves, outputs not of the
    four a task takes, inputs not of the 32 (16, 8) a vector holds."""
    name = str(dtype).removeprefix("torch.")
    if not _small_linear(name):
        pytest.skip(f"no small-batch kernel for {name} on this CPU")
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    exact = F.linear(x.double(), weight.double(), b.double() if b is not None else None)
    got = torch.ops.kvmesh.small_linear(x, weight, b)
    onednn = F.linear(x, weight, b)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    if dtype == torch.float32:  # float32 sums in another order: a few units in the last place of the terms
        bound = (x.double().abs() @ weight.double().abs().T) * 2.0**-22 * in_features**0.5
        assert ((got.double() - exact).abs() <= bound + 1e-6).all()
        return
    ulp = exact.abs() * 2.0**-8 + 1e-6  # half a unit: each output is its float32 sum rounded once
    assert ((got.double() - exact).abs() <= (onednn.double() - exact).abs() + 2 * ulp).all()
    assert (got == onednn).float().mean().item() > 0.99


@small_linear
def test_a_linear_sends_small_batches_to_the_kernel() -> None:
    weight = torch.randn(64, 96).bfloat16()
    linear = Linear(weight, small_rows=2)  # as the plan sets it for bfloat16 on a CPU with AMX
    for rows in (1, 2):
        x = torch.randn(rows, 96).bfloat16()
        torch.testing.assert_close(linear(x), torch.ops.kvmesh.small_linear(x, weight, None), atol=0, rtol=0)
    x = torch.randn(3, 96).bfloat16()
    torch.testing.assert_close(linear(x), Linear(weight)(x), atol=0, rtol=0)


def _weights(dtype: torch.dtype, tied: bool) -> ModelWeights:
    def t(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype)

    layer = LayerWeights(t(8), t(24, 8), None, t(8, 8), t(8), t(32, 8), t(8, 16))  # 1,152 bytes of linears in bf16
    embed = t(50, 8)
    return ModelWeights(embed=embed, layers=[layer, layer], norm=t(8), lm_head=embed if tied else t(50, 8))


@small_linear
def test_the_plan_keeps_plain_weights_within_the_limit(monkeypatch) -> None:
    rows = small_batch.small_rows(torch.bfloat16, cpu_has_amx())
    plan = small_batch.plan(_weights(torch.bfloat16, tied=True), torch.bfloat16, compiled=True, prepacked=True)
    assert (plan.layer_rows, plan.lm_head_rows) == (rows, rows)
    assert "keeping 0 MiB of plain weights" in plan.why

    monkeypatch.setattr(small_batch, "PLAIN_COPY_LIMIT", 2000)  # the two layers' 2,304 bytes do not fit
    if plan.tile_kernel == "vnni":  # nor its packed copy: the output layer's kernel keeps its eight rows
        rows = small_batch.SMALL_ROWS_BF16_UNPACKED
    for tied in (True, False):  # the output layer's plain weight stays either way: no copy
        plan = small_batch.plan(_weights(torch.bfloat16, tied=tied), torch.bfloat16, compiled=True, prepacked=True)
        assert (plan.layer_rows, plan.lm_head_rows) == (0, rows)
        assert plan.why.startswith("on for the output layer only")
    plan = small_batch.plan(_weights(torch.bfloat16, tied=False), torch.bfloat16, compiled=True, prepacked=False)
    assert (plan.layer_rows, plan.lm_head_rows) == (rows, rows)  # not prepacked: nothing copied


@pytest.mark.skipif(paged_kernel.compiler() is None or not paged_kernel.available(), reason="no compiled kernels")
def test_bfloat16_takes_one_row_on_a_cpu_without_amx(monkeypatch) -> None:
    """Without AMX, bfloat16's rows past one go to the packed kernel (test_vnni_linear.py),
    faster there from two rows, and without it to oneDNN (AMD EPYC Zen 4). With AMX,
    the tiles take them from three; an AMX CPU whose tile kernel was not built keeps two rows too
    (oneDNN has the tiles there, and was faster from eight on the Intel Xeons measured). (The CPU
    and its kernels are pretended, so that this runs on any CPU that builds the library.)"""
    monkeypatch.setattr(torch.ops.kvmesh, "small_linear_available", lambda name: True, raising=False)
    monkeypatch.setattr(small_batch, "vnni_available", lambda: False)
    for tile_kernel, amx, rows, tile_rows in ((False, False, 1, 0), (True, True, 2, small_batch.TILE_ROWS), (False, True, 2, 0)):
        monkeypatch.setattr(small_batch, "amx_available", lambda tile_kernel=tile_kernel: tile_kernel)
        monkeypatch.setattr(small_batch, "cpu_has_amx", lambda amx=amx: amx)
        plan = small_batch.plan(_weights(torch.bfloat16, tied=True), torch.bfloat16, compiled=True, prepacked=True)
        assert (plan.layer_rows, plan.lm_head_rows, plan.tile_rows) == (rows, rows, tile_rows), (tile_kernel, amx)
        assert f"small-batch kernel for {'one row' if rows == 1 else f'up to {rows} rows'}" in plan.why


def test_the_plan_is_off_without_the_kernel_or_its_dtype() -> None:
    plan = small_batch.plan(_weights(torch.float16, tied=True), torch.float16, compiled=True, prepacked=True)
    assert (plan.layer_rows, plan.lm_head_rows) == (0, 0) and "this engine runs float16" in plan.why
    plan = small_batch.plan(_weights(torch.bfloat16, tied=True), torch.bfloat16, compiled=False, prepacked=True)
    assert (plan.layer_rows, plan.lm_head_rows) == (0, 0) and "not loaded" in plan.why
    if not torch.ops.kvmesh.small_linear_available("bfloat16"):
        plan = small_batch.plan(_weights(torch.bfloat16, tied=True), torch.bfloat16, compiled=True, prepacked=True)
        assert plan.why == "off: bfloat16 needs AVX512-BF16, which this CPU lacks"
    if _small_linear("float32"):  # four rows; none where the packed kernel is built for AVX2 (it takes them)
        plan = small_batch.plan(_weights(torch.float32, tied=True), torch.float32, compiled=True, prepacked=True)
        rows = 0 if small_batch.f32_packed_available() and small_batch.f32_packed_lanes() == 8 else 4
        assert (plan.layer_rows, plan.lm_head_rows) == (rows, rows)


@small_linear
def test_the_model_with_the_small_batch_kernel_on_and_off(tiny_model_dir) -> None:
    """bfloat16, one-token prompts one at a time (every linear sees one row: the kernel's):
    the first token's log-probabilities are as close to float32's with the kernel as with
    oneDNN (the tokens of a random model may break a near tie either way)."""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams

    config = dict(model=str(tiny_model_dir), block_size=4, num_blocks=64)
    reference = LLMEngine(EngineConfig(dtype="float32", **config))
    reference.model.small_batch_linear = False
    engine = LLMEngine(EngineConfig(dtype="bfloat16", **config))
    assert engine.model.small_batch_linear
    rows = small_batch.small_rows(torch.bfloat16, cpu_has_amx())
    assert all(linear.small_rows == rows for linear in engine.model.linears())
    params = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=8)

    def first_logprobs(eng: LLMEngine, token: int) -> dict[int, float]:
        [out] = eng.generate([[token]], params)
        assert len(out.new_token_ids) == 3
        return dict(out.logprobs[0].top)

    errors = {}
    for on in (True, False):
        engine.model.small_batch_linear = on
        worst = 0.0
        for token in (5, 17, 40, 101):
            worst = max(worst, logprob_gap(first_logprobs(reference, token), first_logprobs(engine, token)))
        errors[on] = worst
    assert not engine.model.small_batch_linear
    assert errors[True] <= 2 * errors[False] + 0.02, errors
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks


@pytest.mark.skipif(not _small_linear("float32"), reason="no float32 small-batch kernel on this CPU")
def test_float32_greedy_tokens_with_the_small_batch_kernel_on_and_off(tiny_model_dir, monkeypatch) -> None:
    """float32: one to four sequences decoding (the kernel's rows) give the same greedy tokens
    with the kernel as with oneDNN (the packed kernel left out: built for AVX2 it takes every row)."""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams

    monkeypatch.setattr(small_batch, "f32_packed_available", lambda: False)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=4, num_blocks=128))
    assert all(linear.small_rows == 4 for linear in engine.model.linears())
    prompts = [[5 + i for i in range(n)] for n in (3, 9, 14, 6)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    runs = []
    for on in (True, False):
        engine.model.small_batch_linear = on
        runs.append([[out.new_token_ids for out in engine.generate(prompts[:count], params)] for count in (1, 4)])
    assert runs[0] == runs[1]
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks
