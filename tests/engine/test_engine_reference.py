"""The engine against transformers on a tiny random Llama / Qwen2: greedy tokens and logits,
alone, batched, in small prefill chunks, under preemption and with prefix-cache hits.
On the CPU unless ``KVMESH_TEST_DEVICE`` names another device (both sides run there)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import SamplingParams
from tests.engine.reference import DEVICE, load_reference, reference_greedy, reference_logits, skip_unless_device_present

skip_unless_device_present()

TEXTS = [
    "The capital of France is",
    "Rivers carry water from the mountains to the sea, and",
    "def add(a, b):\n    return",
    "Cooking pasta needs",
    "A",
    "The old city walls were built of stone and the market square was full of people selling bread",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tiny_model_dir, tiny_qwen2_dir):
    return tiny_model_dir if request.param == "llama" else tiny_qwen2_dir


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir, device=DEVICE)


@pytest.fixture(scope="module")
def prompts(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_blocks=8))
    return [engine.tokenizer.encode(text) for text in TEXTS]


@pytest.fixture(scope="module")
def expected(reference, prompts):
    return [reference_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]


def make_engine(model_dir, **overrides) -> LLMEngine:
    config = dict(model=str(model_dir), block_size=4, num_blocks=256, max_num_batched_tokens=256, device=DEVICE)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
# the grouped prefill over a shared prefix is the CPU's path (ModelRunner.shared_prefill)
CPU_ONLY = pytest.mark.skipif(DEVICE != "cpu", reason="grouped prefill attention runs on the CPU only")


def test_one_request_at_a_time(model_dir, prompts, expected):
    engine = make_engine(model_dir, enable_prefix_caching=False)
    for prompt, want in zip(prompts, expected):
        [out] = engine.generate([prompt], GREEDY)
        assert out.new_token_ids == want


def test_batched(model_dir, prompts, expected):
    engine = make_engine(model_dir)
    outs = engine.generate(prompts, GREEDY)
    assert [o.new_token_ids for o in outs] == expected


def test_chunked_prefill(model_dir, prompts, expected):
    # A 5-token budget splits most prompts into chunks that straddle block boundaries.
    engine = make_engine(model_dir, max_num_batched_tokens=5)
    outs = engine.generate(prompts, GREEDY)
    assert [o.new_token_ids for o in outs] == expected


def _generate_counting_preemptions(engine: LLMEngine, prompts, monkeypatch) -> tuple[list, list[str]]:
    preempted: list[str] = []
    original = engine.scheduler._preempt
    monkeypatch.setattr(engine.scheduler, "_preempt", lambda req: (preempted.append(req.request_id), original(req)))
    return engine.generate(prompts, GREEDY), preempted


def test_preemption(model_dir, prompts, expected, monkeypatch):
    # admission by what fits now, so that the requests outgrow the pool and are recomputed
    engine = make_engine(model_dir, num_blocks=18, reserve_growth=False)
    outs, preempted = _generate_counting_preemptions(engine, prompts, monkeypatch)
    assert preempted, "the pool was meant to be too small for all requests at once"
    assert [o.new_token_ids for o in outs] == expected
    assert engine.pool_stats().num_in_use == 0


def test_the_growth_reserve_saves_preemptions(model_dir, prompts, expected, monkeypatch):
    without, preempted_without = _generate_counting_preemptions(make_engine(model_dir, num_blocks=18, reserve_growth=False), prompts, monkeypatch)
    engine = make_engine(model_dir, num_blocks=18)  # the default: admission keeps blocks back for growth
    outs, preempted = _generate_counting_preemptions(engine, prompts, monkeypatch)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in without] == expected
    assert len(preempted) < len(preempted_without), (preempted, preempted_without)
    assert engine.pool_stats().num_in_use == 0


def test_prefix_cache_hits(model_dir, reference, prompts):
    engine = make_engine(model_dir)
    base = prompts[5]
    engine.generate([base], GREEDY)
    longer = base + prompts[1]
    [out] = engine.generate([longer], GREEDY)
    assert out.num_cached_tokens == (len(base) // 4) * 4
    assert out.new_token_ids == reference_greedy(reference, longer, NEW_TOKENS)
    # The same prompt again: everything but the last token comes from the cache.
    [again] = engine.generate([longer], GREEDY)
    assert again.num_cached_tokens == ((len(longer) - 1) // 4) * 4
    assert again.new_token_ids == out.new_token_ids


def _engine_logits(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """Logits for every prompt position, computed step by step as the scheduler chunks it."""
    req = engine.add_request("logits", tokens, SamplingParams(max_tokens=1))
    rows = []
    while not req.is_finished:
        out = engine.scheduler.schedule()
        input_ids, positions, meta, _, _ = engine.runner.prepare(out)
        hidden = engine.model.forward(input_ids, positions, meta, engine.kv_pool)
        rows.append(engine.model.logits(hidden))
        sampled = [int(rows[-1][-1].argmax())] if out.scheduled[0].samples else []
        engine.scheduler.update_from_output(out, sampled)
    return torch.cat(rows)


@pytest.mark.parametrize("budget", [256, 3])
def test_logits_close(model_dir, reference, prompts, budget):
    engine = make_engine(model_dir, max_num_batched_tokens=budget)
    tokens = prompts[5] + prompts[1]
    got = _engine_logits(engine, tokens)
    want = reference_logits(reference, tokens)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_decode_logits_close_after_cache_hit(model_dir, reference, prompts):
    engine = make_engine(model_dir)
    engine.generate([prompts[5]], GREEDY)
    tokens = prompts[5] + prompts[3]
    got = _engine_logits(engine, tokens)
    want = reference_logits(reference, tokens)
    hit = (len(prompts[5]) // 4) * 4
    torch.testing.assert_close(got, want[hit:], atol=2e-4, rtol=1e-4)


def test_cascade_attention_for_a_shared_prefix(model_dir, reference, prompts, monkeypatch):
    """Sequences decoding together over a common prefix read it once (cascade attention);
    their tokens still equal the reference."""
    from kvmesh.engine import model_runner

    shared_calls = []
    original = model_runner.shared_prefix_blocks
    monkeypatch.setattr(
        model_runner, "shared_prefix_blocks", lambda *a: shared_calls.append(original(*a)) or shared_calls[-1]
    )
    engine = make_engine(model_dir)
    engine.runner.cascade_min_blocks = 2
    prefix = prompts[5] + prompts[1]
    batch = [prefix + p for p in prompts[:4]]
    outs = engine.generate(batch, GREEDY)
    assert max(shared_calls) >= len(prefix) // 4 - 1, "the decode batches were meant to share the prefix"
    assert [o.new_token_ids for o in outs] == [reference_greedy(reference, p, NEW_TOKENS) for p in batch]


def test_cascade_decode_logits_match_plain(model_dir, prompts):
    """The cascade path and the plain path compute the same attention (float32)."""
    from kvmesh.engine.model.attention import _decode_attention

    engine = make_engine(model_dir)
    prefix = prompts[5]
    batch = [prefix + p for p in prompts[:3]]
    engine.generate(batch, SamplingParams(max_tokens=1))
    for index, p in enumerate(batch):
        engine.add_request(f"c{index}", p, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # prefill (all from cache but the last token), now all decode together
    out = engine.scheduler.schedule()
    engine.runner.cascade_min_blocks = 10**9
    _, _, meta, _, _ = engine.runner.prepare(out)
    assert meta.decode is not None and meta.decode.shared_prefix is None
    k_cache, v_cache = engine.kv_pool.layer_views(0)
    torch.manual_seed(0)
    q = torch.randn(meta.num_decode, engine.model_config.num_heads, engine.model_config.head_dim, device=DEVICE)
    plain = _decode_attention(q, k_cache, v_cache, meta.decode, 0.125)
    engine.runner.cascade_min_blocks = 1
    _, _, cascade_meta, _, _ = engine.runner.prepare(out)
    assert cascade_meta.decode.shared_prefix is not None
    cascade = _decode_attention(q, k_cache, v_cache, cascade_meta.decode, 0.125)
    torch.testing.assert_close(cascade, plain, atol=1e-5, rtol=1e-5)
    if engine.model.paged_kernel:  # the own tokens through the compiled kernel, merged by its log-sum-exp
        assert cascade_meta.decode.context_lens is not None
        in_place = _decode_attention(q, k_cache, v_cache, cascade_meta.decode, 0.125, kernel=True)
        torch.testing.assert_close(in_place, plain, atol=1e-5, rtol=1e-5)


def _shared_prefix_batch(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Four prompts on one cached prefix: three begin their own tokens where the prefix
    ends, one after more cached blocks of its own."""
    prefix = prompts[5] + prompts[1]
    engine.generate([prefix], SamplingParams(max_tokens=1))
    engine.generate([prefix + prompts[0]], SamplingParams(max_tokens=1))
    return [prefix + prompts[0] + prompts[2]] + [prefix + p for p in prompts[1:4]]


@CPU_ONLY
def test_prefill_chunks_on_a_cached_prefix_read_it_once(model_dir, reference, prompts, monkeypatch):
    """Prompts on one cached prefix, prefilled in the same step, attend to it as one group
    (SharedPrefill); their tokens still equal the reference, for a chunk beginning where the
    prefix ends and for one beginning after more cached blocks of its own."""
    from kvmesh.engine.model import attention

    groups = []
    original = attention._shared_prefill_attention
    monkeypatch.setattr(attention, "_shared_prefill_attention", lambda *a: groups.append(a[5]) or original(*a))
    engine = make_engine(model_dir)
    engine.runner.cascade_min_blocks = 2
    batch = _shared_prefix_batch(engine, prompts)
    outs = engine.generate(batch, GREEDY)
    assert [len(group.spans) for group in groups] == [4] * engine.model_config.num_layers
    spans = groups[0].spans
    assert sum(span.block_table is not None for span in spans) == 1, "one chunk begins after its own cached blocks"
    assert [o.new_token_ids for o in outs] == [reference_greedy(reference, p, NEW_TOKENS) for p in batch]
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks  # all freed or cached


@CPU_ONLY
def test_shared_prefill_attention_matches_plain(model_dir, prompts):
    """The grouped prefill attention and the per-chunk one compute the same values (float32)."""
    from kvmesh.engine.model.attention import paged_attention, write_kv

    engine = make_engine(model_dir)
    engine.runner.cascade_min_blocks = 2
    for index, prompt in enumerate(_shared_prefix_batch(engine, prompts)):
        engine.add_request(f"s{index}", prompt, SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    _, _, grouped, _, _ = engine.runner.prepare(out)
    assert len(grouped.shared_prefills) == 1 and not grouped.prefills
    engine.runner.shared_prefill = False
    _, _, plain, _, _ = engine.runner.prepare(out)
    assert not plain.shared_prefills and len(plain.prefills) == 4
    cfg = engine.model_config
    k_cache, v_cache = engine.kv_pool.layer_views(0)
    torch.manual_seed(0)
    tokens = out.num_tokens
    q = torch.randn(tokens, cfg.num_heads, cfg.head_dim)
    k, v = torch.randn(2, tokens, cfg.num_kv_heads, cfg.head_dim)
    write_kv(k_cache, v_cache, k, v, plain)
    want = paged_attention(q, k, v, k_cache, v_cache, plain, 0.125)
    got = paged_attention(q, k, v, k_cache, v_cache, grouped, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cascade_gathers_the_prefix_once_and_never_a_stale_one(model_dir, reference, prompts, monkeypatch):
    """Decode steps over one shared prefix gather its K/V once per layer and reuse them, with
    the tokens of the reference. Once the prefix's blocks are taken for new content (their
    epochs move), the kept K/V are not offered for the same block ids again."""
    from kvmesh.engine.model import attention

    gathers: list[int] = []
    original = attention._gather_view
    monkeypatch.setattr(attention, "_gather_view", lambda *a: gathers.append(1) or original(*a))
    engine = make_engine(model_dir)
    runner = engine.runner
    runner.cascade_min_blocks = 2
    kept: list[tuple[list[int], object]] = []
    decode_batch = runner._decode_batch

    def recording(tables, context_lens):
        batch = decode_batch(tables, context_lens)
        if batch.shared_prefix is not None:
            if not kept:
                gathers.clear()  # count the decode steps' own: the prefills before gather too
            kept.append((batch.shared_prefix.tolist(), batch.prefix_kv))
        return batch

    monkeypatch.setattr(runner, "_decode_batch", recording)
    batch = [prompts[5] + prompts[1] + p for p in prompts[:4]]
    outs = engine.generate(batch, GREEDY)
    assert [o.new_token_ids for o in outs] == [reference_greedy(reference, p, NEW_TOKENS) for p in batch]
    assert len(kept) >= NEW_TOKENS - 1, "the decode steps were meant to share the prefix"
    assert len({id(slots) for _, slots in kept}) == 1  # one set of kept K/V for every step
    assert len(gathers) == 2 * engine.model_config.num_layers  # K and V once per layer, not once a step

    prefix_ids = kept[0][0]
    assert runner._gathered_prefix(prefix_ids) is kept[0][1]  # blocks unchanged: offered again
    pool = engine.kv_manager.pool
    retaken = pool.get_new_blocks(pool.num_free_blocks)  # every free block, the prefix's among them, for new content
    fresh = runner._gathered_prefix(prefix_ids)
    assert fresh is not kept[0][1] and fresh == [None] * engine.model_config.num_layers
    pool.free_blocks(retaken)
    assert pool.num_free_blocks == pool.num_blocks


def test_cascade_without_the_kept_prefix_gathers_each_step(model_dir, reference, prompts):
    """``reuse_prefix_gather`` off: the same tokens, nothing kept."""
    engine = make_engine(model_dir)
    engine.runner.cascade_min_blocks = 2
    engine.runner.reuse_prefix_gather = False
    batch = [prompts[5] + prompts[1] + p for p in prompts[:4]]
    outs = engine.generate(batch, GREEDY)
    assert [o.new_token_ids for o in outs] == [reference_greedy(reference, p, NEW_TOKENS) for p in batch]
    assert engine.runner._prefix_kv is None
