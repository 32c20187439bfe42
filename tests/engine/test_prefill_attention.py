"""The compiled prefill attention (csrc/prefill_attention.cpp), bfloat16 and float32, against
float64 and against PyTorch's flash attention, and through the engine: where the CPU has no
AVX512-BF16 (bfloat16) or no AVX-512 (float32) the kernel is not built and these tests skip (the
engine keeps flash attention there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.engine.model import paged_kernel


def _built(dtype: torch.dtype) -> bool:
    return paged_kernel.compiler() is not None and paged_kernel.available() and paged_kernel.prefill_attention_built(dtype)


BF16 = pytest.mark.skipif(not _built(torch.bfloat16), reason="the bfloat16 prefill kernel is not built here (no AVX512-BF16)")
DTYPES = pytest.mark.parametrize(
    "dtype",
    [pytest.param(torch.bfloat16, marks=BF16),
     pytest.param(torch.float32, marks=pytest.mark.skipif(not _built(torch.float32), reason="no float32 prefill kernel here (no AVX-512)"))],
)  # fmt: skip
# The bounds on the kernel's error against float64, from flash attention's in the same dtype:
# (factor on flash's largest error, absolute slack), (factor on its mean error, slack). float32's
# errors are a fraction of an ulp on average, where another order of the same sums moves the
# mean of a few hundred values by up to 1.4x (measured: 1 query on 17 keys); the slack covers
# rows whose errors are near 0 for both (a row of one key is that key's V).
BOUNDS = {torch.bfloat16: ((1.5, 1e-3), (1.1, 1e-5)), torch.float32: ((2.0, 1e-7), (1.5, 1e-9))}


def _assert_as_close_as_flash(error: torch.Tensor, flash_error: torch.Tensor, dtype: torch.dtype) -> None:
    (most, most_slack), (mean, mean_slack) = BOUNDS[dtype]
    assert error.max() <= most * flash_error.max() + most_slack
    assert error.mean() <= mean * flash_error.mean() + mean_slack


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
@DTYPES
def test_the_kernel_is_as_close_to_float64_as_flash_attention(length: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    """q and k strided slices of one qkv tensor, as the model passes them, v a view with rows
    and heads strided otherwise; every row attends to the keys up to its own. Its error against
    float64 is flash attention's in the same dtype."""
    gen = torch.Generator().manual_seed(length)
    qk = (torch.randn(length, heads + kv_heads, dim, generator=gen) * 2).to(dtype)
    q, k = qk[:, :heads], qk[:, heads:]
    v = torch.randn(length, kv_heads, dim + 8, generator=gen).to(dtype)[..., :dim]
    scale = dim**-0.5
    exact = _causal(q, k, v, scale, torch.float64)
    got = torch.ops.kvmesh.prefill_attention(q, k, v, scale)
    flash = _causal(q, k, v, scale, dtype).double()
    assert got.dtype == dtype and got.shape == (length, heads, dim) and got.is_contiguous()
    error, flash_error = (got.double() - exact).abs(), (flash - exact).abs()
    _assert_as_close_as_flash(error, flash_error, dtype)


def _after_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Query row r is at position S - L + r and attends to the keys up to it."""
    length, keys = q.shape[0], k.shape[0]
    visible = torch.arange(keys).unsqueeze(0) <= (keys - length + torch.arange(length)).unsqueeze(1)

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).transpose(0, 1).unsqueeze(0)

    out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), attn_mask=visible, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


@pytest.mark.parametrize(
    ("length", "keys", "heads", "kv_heads", "dim"),
    [(1, 17, 9, 3, 64), (5, 40, 9, 3, 64), (16, 48, 9, 3, 64), (33, 300, 9, 3, 64), (7, 100, 8, 1, 128), (64, 65, 4, 4, 64)],
)  # fmt: skip
@DTYPES
def test_a_chunk_after_earlier_context_attends_to_it(length: int, keys: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    """K/V longer than the queries: the chunk is the last ``length`` of ``keys`` positions (a
    cached prefix before it), each row attending to the context and to its chunk up to itself;
    as close to float64 as flash attention with that mask."""
    gen = torch.Generator().manual_seed(keys)
    q = (torch.randn(length, heads, dim, generator=gen) * 2).to(dtype)
    kv = torch.randn(keys, 2, kv_heads, dim, generator=gen).to(dtype)
    k, v = kv[:, 0], kv[:, 1]  # rows strided as the pool's gathered blocks are not: any stride is read
    scale = dim**-0.5
    exact = _after_context(q, k, v, scale, torch.float64)
    got = torch.ops.kvmesh.prefill_attention(q, k, v, scale)
    flash = _after_context(q, k, v, scale, dtype).double()
    error, flash_error = (got.double() - exact).abs(), (flash - exact).abs()
    assert got.shape == (length, heads, dim)
    _assert_as_close_as_flash(error, flash_error, dtype)
    # the last row sees every key, the first only the context and itself: not a causal square
    assert not torch.allclose(got.double(), _causal(q, k[-length:], v[-length:], scale, torch.float64), atol=0.05)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("length", "keys", "heads", "kv_heads", "dim"), [(5, 40, 9, 3, 64), (33, 100, 8, 2, 128), (16, 16, 9, 3, 64), (40, 16, 9, 3, 64)])
@DTYPES
def test_the_log_sum_exp_variant_gives_each_rows_lse(
    causal: bool, length: int, keys: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    """``prefill_attention_lse``: the same output, causal or every row to every key (a shared
    prefix's part), and each row's log-sum-exp of its scaled scores, as float64 has it."""
    gen = torch.Generator().manual_seed(keys + length)
    q = (torch.randn(length, heads, dim, generator=gen) * 2).to(dtype)
    k = torch.randn(keys, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(keys, kv_heads, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    if causal and length > keys:
        with pytest.raises(RuntimeError, match="shapes"):  # a chunk's queries are among its keys
            torch.ops.kvmesh.prefill_attention_lse(q, k, v, scale, causal)
        return
    out, lse = torch.ops.kvmesh.prefill_attention_lse(q, k, v, scale, causal)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (length, heads)
    scores = torch.einsum("lhd,shd->hls", q.double(), k.double().repeat_interleave(heads // kv_heads, dim=1)) * scale
    if causal:
        visible = torch.arange(keys).unsqueeze(0) <= (keys - length + torch.arange(length)).unsqueeze(1)
        scores = scores.masked_fill(~visible, float("-inf"))
        assert torch.equal(out, torch.ops.kvmesh.prefill_attention(q, k, v, scale))
    exact_lse = torch.logsumexp(scores, dim=-1).transpose(0, 1)
    # bfloat16: q.k's products exact, sums in float32; float32: products and sums rounded
    torch.testing.assert_close(lse.double(), exact_lse, atol=0.02 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    exact = torch.einsum("hls,shd->lhd", torch.softmax(scores, dim=-1), v.double().repeat_interleave(heads // kv_heads, dim=1))
    assert (out.double() - exact).abs().max() < (0.05 if dtype == torch.bfloat16 else 1e-5)


@BF16
def test_bad_inputs_are_refused_by_name() -> None:
    q = torch.zeros(4, 6, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 or float32 only"):
        torch.ops.kvmesh.prefill_attention(q.half(), q[:, :2].half(), q[:, :2].half(), 0.125)
    with pytest.raises(RuntimeError, match="the same for q, k and v"):
        torch.ops.kvmesh.prefill_attention(q, q[:, :2].float(), q[:, :2], 0.125)
    with pytest.raises(RuntimeError, match="no kernel for this head dim"):
        small = torch.zeros(4, 6, 16, dtype=torch.bfloat16)
        torch.ops.kvmesh.prefill_attention(small, small[:, :2], small[:, :2], 0.25)
    with pytest.raises(RuntimeError, match="no kernel for this head dim or group"):  # 9 query heads a KV head
        wide = torch.zeros(4, 18, 64, dtype=torch.bfloat16)
        torch.ops.kvmesh.prefill_attention(wide, wide[:, :2], wide[:, :2], 0.125)
    with pytest.raises(RuntimeError, match="shapes"):  # fewer keys than queries
        torch.ops.kvmesh.prefill_attention(q, q[:3, :2], q[:3, :2], 0.125)


@BF16
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
    exact.model.prefill_kernel = False  # a reference independent of the kernel (its float32 path)
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


@BF16
def test_chunks_after_earlier_context_go_through_it_with_the_logprobs_of_flash_attention(tmp_path, monkeypatch) -> None:
    """A prompt chunked by the step's token budget, and prompts whose first blocks are in the
    prefix cache, attend to that earlier context through the kernel too (calls with more keys
    than queries: counted): the chunked prompt's logprobs, and the next token's after a cached
    prefix, as close to a float32 engine's as flash attention's."""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams
    from kvmesh.testing.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny64", arch="llama", seed=2, hidden_size=256, num_heads=4, num_kv_heads=2)

    def engine(dtype: str) -> LLMEngine:
        config = EngineConfig(model=str(model_dir), dtype=dtype, block_size=4, num_blocks=256, max_num_batched_tokens=32)
        return LLMEngine(config)

    shared = [5 + (i * 7) % 200 for i in range(40)]
    first = [*shared, *[9 + (i * 5) % 190 for i in range(50)]]  # 90 tokens: chunks of 32, 32, 26
    follow_ups = [[*shared, *[11 + (i * j) % 180 for i in range(n)]] for j, n in ((3, 6), (13, 21))]  # 40 tokens cached

    def run(e: LLMEngine) -> list:  # one at a time: the follow-ups find the first prompt's blocks cached
        # (a request for prompt logprobs looks up no cache: the follow-ups ask for the next token's)
        chunked = e.generate([first], SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=0))
        return chunked + [e.generate([p], SamplingParams(max_tokens=1, ignore_eos=True, logprobs=8))[0] for p in follow_ups]

    kernel_engine = engine("bfloat16")
    if not kernel_engine.model.prefill_kernel:
        pytest.skip("the engine keeps flash attention on this CPU (AMX)")
    real, calls = torch.ops.kvmesh.prefill_attention, []

    def counted(*args):
        calls.append((args[0].shape[0], args[1].shape[0]))
        return real(*args)

    monkeypatch.setattr(torch.ops.kvmesh, "prefill_attention", counted)
    with_kernel = run(kernel_engine)
    layers = len(kernel_engine.model.layers)
    assert sorted(set(calls)) == [(6, 46), (21, 61), (26, 90), (32, 32), (32, 64)]  # (queries, keys)
    assert len(calls) == 5 * layers
    flash_engine = engine("bfloat16")
    flash_engine.model.prefill_kernel = False
    with_flash = run(flash_engine)
    assert len(calls) == 5 * layers  # none with the kernel off
    reference_engine = engine("float32")
    reference_engine.model.prefill_kernel = False  # a reference independent of the kernel (its float32 path)
    reference = run(reference_engine)
    assert [out.num_cached_tokens for out in (*with_kernel, *reference)] == [0, 40, 40] * 2

    def errors(outputs) -> list[float]:  # the chunked prompt's logprobs, then the follow-ups' top 8 next tokens
        found = [abs(got.logprob - want.logprob)
                 for got, want in zip(outputs[0].prompt_logprobs[1:], reference[0].prompt_logprobs[1:], strict=True)]  # fmt: skip
        for out, ref in zip(outputs[1:], reference[1:], strict=True):
            top = dict(out.logprobs[0].top)
            found += [abs(top[token] - logprob) for token, logprob in ref.logprobs[0].top if token in top]
        return found

    kernel_errors, flash_errors = errors(with_kernel), errors(with_flash)
    assert len(kernel_errors) >= 89 + 8
    assert max(kernel_errors) <= 1.5 * max(flash_errors) + 0.02
    assert sum(kernel_errors) <= 1.2 * sum(flash_errors) + 0.01 * len(kernel_errors)


@pytest.mark.skipif(not _built(torch.float32), reason="no float32 prefill kernel here (no AVX-512)")
def test_a_float32_engine_prefills_through_it_with_flash_attentions_logprobs(tmp_path, monkeypatch) -> None:
    """A float32 engine on a model of 64-dim heads uses the kernel where the CPU has no AMX: for
    fresh prompts, a prompt chunked by the step's token budget and follow-ups after a cached
    prefix (calls with more keys than queries: counted); its prompt logprobs and next-token
    top-8 logprobs are flash attention's within float32's rounding, its greedy tokens equal."""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams
    from kvmesh.testing.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny64", arch="llama", seed=4, hidden_size=256, num_heads=4, num_kv_heads=2)
    config = EngineConfig(model=str(model_dir), dtype="float32", block_size=4, num_blocks=256, max_num_batched_tokens=32)
    engine, flash_engine = LLMEngine(config), LLMEngine(config)
    assert engine.model.prefill_kernel == paged_kernel.prefill_attention_wanted(64, 2, torch.float32)
    if not engine.model.prefill_kernel:
        pytest.skip("the engine keeps flash attention on this CPU (AMX)")
    shared = [5 + (i * 7) % 200 for i in range(40)]
    first = [*shared, *[9 + (i * 5) % 190 for i in range(50)]]  # 90 tokens: chunks of 32, 32, 26
    follow_ups = [[*shared, *[11 + (i * j) % 180 for i in range(n)]] for j, n in ((3, 6), (13, 21))]  # 40 tokens cached

    def run(e: LLMEngine) -> list:  # one at a time: the follow-ups find the first prompt's blocks cached
        fresh = e.generate([[3 + i % 50 for i in range(n)] for n in (3, 17)], SamplingParams(max_tokens=6, prompt_logprobs=0))
        chunked = e.generate([first], SamplingParams(max_tokens=6, prompt_logprobs=0))
        return fresh + chunked + [e.generate([p], SamplingParams(max_tokens=6, logprobs=8))[0] for p in follow_ups]

    real, calls = torch.ops.kvmesh.prefill_attention, []

    def counted(*args):
        calls.append((args[0].shape[0], args[1].shape[0]))
        return real(*args)

    monkeypatch.setattr(torch.ops.kvmesh, "prefill_attention", counted)
    with_kernel = run(engine)
    assert {(3, 3), (17, 17), (32, 32), (32, 64), (26, 90), (6, 46), (21, 61)} <= set(calls)  # (queries, keys)
    flash_engine.model.prefill_kernel = False
    prompt_calls = len(calls)
    with_flash = run(flash_engine)
    assert len(calls) == prompt_calls  # none with the kernel off
    assert [out.num_cached_tokens for out in with_kernel] == [0, 0, 0, 40, 40]
    assert [out.new_token_ids for out in with_kernel] == [out.new_token_ids for out in with_flash]
    differences = []
    for got, want in zip(with_kernel, with_flash, strict=True):
        if want.prompt_logprobs:
            differences += [abs(a.logprob - b.logprob) for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True)]
        else:
            top = dict(got.logprobs[0].top)
            differences += [abs(top[token] - logprob) for token, logprob in want.logprobs[0].top]
    assert len(differences) == 2 + 16 + 89 + 16 and max(differences) < 1e-4


@DTYPES
def test_a_shared_prefix_group_goes_through_it_as_close_to_float64_as_flash_attention(tmp_path, dtype: torch.dtype) -> None:
    """Prompts on one cached prefix, prefilled in one step, form a ``SharedPrefill``: with the
    kernel both its parts (every query against the prefix, each chunk against its own context)
    go through ``prefill_attention_lse`` and merge by the log-sum-exp; the result is as close to
    float64 (the plain per-chunk attention of the same step) as flash attention's grouped one."""
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.model.attention import paged_attention, write_kv
    from kvmesh.engine.request import SamplingParams
    from kvmesh.testing.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny64", arch="llama", seed=3, hidden_size=256, num_heads=4, num_kv_heads=2)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=str(dtype).removeprefix("torch."), block_size=4, num_blocks=256))
    if not engine.model.prefill_kernel:
        pytest.skip("the engine keeps flash attention on this CPU (AMX)")
    engine.runner.cascade_min_blocks = 2
    prefix = [7 + (i * 11) % 150 for i in range(26)]
    engine.generate([prefix], SamplingParams(max_tokens=1))
    engine.generate([prefix + [3, 4, 5, 6, 7, 8, 9]], SamplingParams(max_tokens=1))
    batch = [prefix + [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], *[prefix + [20 + j] * (5 + 3 * j) for j in range(3)]]
    for index, prompt in enumerate(batch):
        engine.add_request(f"s{index}", prompt, SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    _, _, grouped, _, _ = engine.runner.prepare(out)
    assert len(grouped.shared_prefills) == 1 and not grouped.prefills
    assert sum(span.block_table is not None for span in grouped.shared_prefills[0].spans) == 1  # after cached blocks of its own
    engine.runner.shared_prefill = False
    _, _, plain, _, _ = engine.runner.prepare(out)
    cfg = engine.model_config
    k_cache, v_cache = engine.kv_pool.layer_views(0)
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(out.num_tokens, cfg.num_heads, cfg.head_dim, generator=gen) * 2).to(dtype)
    k, v = torch.randn(2, out.num_tokens, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(dtype)
    write_kv(k_cache, v_cache, k, v, plain)
    scale = cfg.head_dim**-0.5
    exact = paged_attention(q.double(), k.double(), v.double(), k_cache.double(), v_cache.double(), plain, scale)
    kernel = paged_attention(q, k, v, k_cache, v_cache, grouped, scale, prefill_kernel=True)
    flash = paged_attention(q, k, v, k_cache, v_cache, grouped, scale)
    error, flash_error = (kernel.double() - exact).abs(), (flash.double() - exact).abs()
    _assert_as_close_as_flash(error, flash_error, dtype)
