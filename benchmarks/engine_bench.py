"""kvmesh engine vs Hugging Face transformers ``generate`` on SmolLM2-135M-Instruct (CPU).

Both engines run in the same process, on the same machine, with the same weights (the
kvmesh default model directory, which transformers loads as an HF checkpoint) and get
identical prompt token ids. Decoding is greedy and ignores EOS, so every run produces
exactly the requested number of tokens.

Workloads, per dtype (``--dtypes``, default ``bfloat16,float32``):

1. batch-1 decode: one ~32-token prompt, 128 new tokens; decode tokens/s excludes the
   prefill (it is timed from the first generated token to the last), time to first token
   is reported on its own.
2. concurrent: 32 requests of ~128 prompt tokens (lengths jittered by +-12.5 %), 128 new
   tokens each; output tokens/s. kvmesh gets all requests at once; transformers runs
   left-padded batches of each ``--hf-batch-sizes`` size and the best is reported.
3. prefill: 4 prompts of 1,024 tokens, 1 new token; prompt tokens/s. transformers: one
   forward (``logits_to_keep=1``) per prompt at batch 1 and all prompts batched; best.
4. shared prefix: 16 requests sharing a 2,048-token prefix, each + 32 own tokens, 16 new
   tokens; total wall time for kvmesh with prefix caching on and off, and transformers
   (batched) for reference.

Every prompt starts with a unique short header ("Note 17. ..."), so no run ever hits blocks
cached by an earlier run or round: the prefix cache only helps where the workload itself
shares a prefix (workload 4). Each engine is warmed up once; each measurement is repeated
``--rounds`` times, interleaved between engines, and the median is reported. A small
machine section measures memory bandwidth and matmul rate, for judging what bounds a result.

Run (on a quiet machine; takes a while, mostly transformers at batch 1 and bfloat16)::

    .venv/bin/python benchmarks/engine_bench.py --out docs/benchmarks-engine.json \
        --markdown docs/benchmarks.md

Smoke test (seconds)::

    .venv/bin/python benchmarks/engine_bench.py --quick --dtypes float32 --hf-batch-sizes 4
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import SamplingParams
from kvmesh.machine import cpu_flags, cpu_model

log = logging.getLogger("engine_bench")

KVMESH = "kvmesh"
KVMESH_NO_CACHE = "kvmesh (prefix caching off)"
HF = "transformers"

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Real English text; prompts are cut from its token ids (repeated as needed).
CORPUS = """\
The harbour town woke slowly in winter. Before the sun had cleared the hills, the fishing
boats were already out beyond the breakwater, their lamps bobbing like loose stars, and the
bakery on the corner had lit its ovens. By seven the smell of bread reached the market square,
where the stallholders unfolded their tables and argued, as they did every morning, about the
price of onions and whether the weather would hold until the afternoon.

Most visitors came in summer and never saw this side of the place. They saw the painted
shutters and the crowded terraces, the ferry that left every hour for the islands, the
children diving from the end of the pier. In January the terraces were stacked with chairs,
the ferry ran twice a day if the sea allowed it, and the town belonged again to the people
who lived there all year: the fishermen and their families, a doctor, two teachers, the
harbour master, and an old man who repaired clocks in a shop no wider than a corridor.

The clockmaker had come from the north forty years earlier, intending to stay a season. He
liked to say that the town had simply forgotten to send him home. His shop was full of
instruments in various states of repair: a brass carriage clock without its hands, a tall
case clock whose pendulum hung still, dozens of pocket watches laid out on felt like
specimens in a museum. Customers brought him things that had stopped, and he returned them
weeks later, ticking, with a handwritten note describing what he had found inside.

Engineers who build large software systems sometimes talk about their work in much the same
way. A system that serves many users at once is a collection of small mechanisms, each of
which must keep time with the others. A request arrives, waits in a queue, is admitted when
there is room, and is served a little at a time alongside hundreds of others. Memory is
divided into blocks, handed out as requests grow and returned when they finish. When the
load is light, nobody notices the machinery; when it is heavy, every inefficiency shows.

Measuring such a system honestly is harder than it sounds. A single number hides the shape
of the workload that produced it. Throughput measured with one user tells you little about
throughput with a hundred, and the time to produce the first word of an answer matters as
much to a person waiting at a screen as the rate at which the rest of the words appear. A
careful benchmark states what it ran, on which machine, how many times, and what it left out.

The library in the town hall kept a shelf of such records for the harbour itself: tide
tables going back a century, the dates of great storms, the weight of every catch landed in
the years when the fish were plentiful and in the years when they were not. Students from
the university sometimes came to copy them, and the librarian, who had read most of them
twice, would point out the years when the handwriting changed, or when someone had clearly
guessed a number rather than measured it, and explain why the difference mattered.

In the evening the boats came back in the order they had left, more or less, and the
harbour filled with noise: engines, gulls, the scrape of crates on stone. The catch was
weighed and written down, the nets were hung to dry, and the men walked up the hill in small
groups toward their houses, where the windows were already lit. The clockmaker closed his
shutters at six exactly, by his own reckoning, which was generally agreed to be correct.
"""


# ----------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Sizes:
    decode_prompt_len: int = 32
    decode_new_tokens: int = 128
    concurrent_requests: int = 32
    concurrent_prompt_len: int = 128
    concurrent_new_tokens: int = 128
    prefill_prompt_len: int = 1024
    prefill_prompts: int = 4
    shared_prefix_len: int = 2048
    shared_requests: int = 16
    shared_suffix_len: int = 32
    shared_new_tokens: int = 16
    bandwidth_mib: int = 512
    matmul_n: int = 2048


QUICK = Sizes(
    decode_prompt_len=32,
    decode_new_tokens=8,
    concurrent_requests=4,
    concurrent_prompt_len=64,
    concurrent_new_tokens=8,
    prefill_prompt_len=128,
    prefill_prompts=2,
    shared_prefix_len=256,
    shared_requests=4,
    shared_suffix_len=32,
    shared_new_tokens=4,
    bandwidth_mib=128,
    matmul_n=1024,
)


# ----------------------------------------------------------------------------- results


@dataclass
class Measurement:
    """One metric of one engine on one workload, over all rounds."""

    workload: str
    metric: str
    engine: str
    dtype: str
    unit: str
    higher_is_better: bool
    samples: list[float] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)  # e.g. the best HF batch size

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "median": self.median}


@dataclass
class Row:
    """A line of the table: a metric, kvmesh's value and transformers' value (if any)."""

    workload: str
    metric: str
    kvmesh: Measurement | None
    hf: Measurement | None
    note: str = ""


@dataclass
class DtypeResult:
    dtype: str
    rows: list[Row] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)
    engine_config: dict[str, Any] = field(default_factory=dict)


def best_of(candidates: dict[str, Measurement], *, label: str) -> Measurement:
    """The candidate with the best median; its key goes into ``detail[label]``."""
    key = max(
        candidates,
        key=lambda k: candidates[k].median if candidates[k].higher_is_better else -candidates[k].median,
    )
    best = dataclasses.replace(candidates[key], detail={**candidates[key].detail, label: key})
    best.detail["all_medians"] = {k: m.median for k, m in candidates.items()}
    return best


# ----------------------------------------------------------------------------- prompts


class PromptMaker:
    """Deterministic prompts cut from ``CORPUS``; each starts with a unique header, so no two
    prompts share a leading KV block unless a workload builds them to."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.corpus = tokenizer.encode(CORPUS)
        self.count = 0

    def make(self, length: int) -> list[int]:
        self.count += 1
        head = self.tokenizer.encode(f"Note {self.count}. ")
        offset = (self.count * 97) % len(self.corpus)
        need = max(0, length - len(head))
        repeats = (offset + need) // len(self.corpus) + 1
        body = (self.corpus * repeats)[offset : offset + need]
        return (head + body)[:length]


def jittered_lengths(count: int, mean: int, jitter: float) -> list[int]:
    """``count`` deterministic lengths spread evenly over mean * (1 +- jitter), mean ~ ``mean``."""
    if count == 1 or jitter <= 0:
        return [mean] * count
    spread = int(mean * jitter)
    steps = [round(-spread + 2 * spread * i / (count - 1)) for i in range(count)]
    order = [(i * 7) % count for i in range(count)]  # shuffle deterministically
    if len(set(order)) != count:
        order = list(range(count))
    return [max(2, mean + steps[j]) for j in order]


# ----------------------------------------------------------------------------- kvmesh runs


@dataclass
class RunTiming:
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    first_token_s: list[float]  # per request, from submission
    token_times_s: list[list[float]]  # per request, timestamp of each output token from t0
    outputs: list[list[int]]
    cached_tokens: int = 0


class KvmeshRunner:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.serial = 0

    def run(self, prompts: Sequence[list[int]], new_tokens: int) -> RunTiming:
        """Submit every prompt at once and step until all finish."""
        engine = self.engine
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        ids = []
        t0 = time.perf_counter()
        for prompt in prompts:
            self.serial += 1
            rid = f"bench-{self.serial}"
            engine.add_request(rid, prompt, params)
            ids.append(rid)
        index = {rid: i for i, rid in enumerate(ids)}
        times: list[list[float]] = [[] for _ in ids]
        outputs: list[list[int]] = [[] for _ in ids]
        cached = [0] * len(ids)
        while engine.has_unfinished():
            step_out = engine.step()
            now = time.perf_counter() - t0
            for out in step_out:
                i = index[out.request_id]
                outputs[i].extend(out.new_token_ids)
                times[i].extend([now] * len(out.new_token_ids))
                cached[i] = out.num_cached_tokens
        wall = time.perf_counter() - t0
        bad = [len(o) for o in outputs if len(o) != new_tokens]
        if bad:
            raise RuntimeError(f"kvmesh produced {bad} tokens instead of {new_tokens}")
        return RunTiming(
            wall_s=wall,
            output_tokens=sum(len(o) for o in outputs),
            prompt_tokens=sum(len(p) for p in prompts),
            first_token_s=[t[0] for t in times],
            token_times_s=times,
            outputs=outputs,
            cached_tokens=sum(cached),
        )


def load_kvmesh(dtype: str, args: argparse.Namespace, *, prefix_caching: bool = True) -> LLMEngine:
    config = EngineConfig(
        model=args.model,
        dtype=dtype,
        kv_cache_bytes=int(args.kv_cache_gib * 2**30),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=prefix_caching,
    )
    if args.block_size:
        config.block_size = args.block_size
    return LLMEngine(config)


# ----------------------------------------------------------------------------- transformers runs


class _TimingStreamer:
    """A ``generate`` streamer recording when each generated token (batch 1) comes out."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def put(self, value: torch.Tensor) -> None:  # first call: the prompt, before the prefill
        self.calls.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFRunner:
    def __init__(self, model_dir: Path, dtype: str, pad_token_id: int) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=TORCH_DTYPES[dtype]
        ).eval()
        self.pad = pad_token_id
        log.info("transformers model loaded (%s, attention %s)", dtype, self.model.config._attn_implementation)

    def _left_pad(self, prompts: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        return ids, mask

    def _generate(self, prompts: Sequence[list[int]], new_tokens: int, streamer: Any = None) -> torch.Tensor:
        ids, mask = self._left_pad(prompts)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # suppresses EOS: every row gets exactly new_tokens
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=self.pad,
            streamer=streamer,
        )
        generated = out[:, ids.shape[1] :]
        if generated.shape[1] != new_tokens:
            raise RuntimeError(f"transformers produced {generated.shape[1]} tokens instead of {new_tokens}")
        return generated

    @torch.inference_mode()
    def run_single(self, prompt: list[int], new_tokens: int) -> RunTiming:
        """Batch 1 with per-token timestamps."""
        streamer = _TimingStreamer()
        t0 = time.perf_counter()
        generated = self._generate([prompt], new_tokens, streamer)
        wall = time.perf_counter() - t0
        token_times = [t - t0 for t in streamer.calls[1:]]  # calls[0] is the prompt
        return RunTiming(wall, new_tokens, len(prompt), [token_times[0]], [token_times], [generated[0].tolist()])

    @torch.inference_mode()
    def run_batched(self, prompts: Sequence[list[int]], new_tokens: int, batch_size: int) -> RunTiming:
        outputs: list[list[int]] = []
        t0 = time.perf_counter()
        for start in range(0, len(prompts), batch_size):
            generated = self._generate(prompts[start : start + batch_size], new_tokens)
            outputs.extend(generated.tolist())
        wall = time.perf_counter() - t0
        return RunTiming(wall, len(prompts) * new_tokens, sum(len(p) for p in prompts), [], [], outputs)

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[list[int]], batch_size: int) -> float:
        """One forward per batch (KV cache built, logits of the last position only); wall s."""
        t0 = time.perf_counter()
        for start in range(0, len(prompts), batch_size):
            ids, mask = self._left_pad(prompts[start : start + batch_size])
            out = self.model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
            out.logits[:, -1].argmax(-1).tolist()
        return time.perf_counter() - t0


# ----------------------------------------------------------------------------- workloads


@dataclass
class Context:
    dtype: str
    sizes: Sizes
    args: argparse.Namespace
    prompts: PromptMaker
    kv: KvmeshRunner
    hf: HFRunner | None

    def m(self, workload: str, metric: str, engine: str, unit: str, higher: bool) -> Measurement:
        return Measurement(workload, metric, engine, self.dtype, unit, higher)

    def hf_batch_sizes(self, count: int) -> list[int]:
        return sorted({min(b, count) for b in self.args.hf_batch_sizes}, reverse=True)


def warm_up(ctx: Context) -> None:
    """A short run through prefill, batched decode and (for transformers) padding."""
    prompts = [ctx.prompts.make(48), ctx.prompts.make(40)]
    t0 = time.perf_counter()
    ctx.kv.run(prompts, 4)
    log.info("warm-up: kvmesh %.2fs", time.perf_counter() - t0)
    if ctx.hf is not None:
        t0 = time.perf_counter()
        ctx.hf.run_batched(prompts, 4, 2)
        ctx.hf.run_single(prompts[0], 4)
        ctx.hf.prefill(prompts, 2)
        log.info("warm-up: transformers %.2fs", time.perf_counter() - t0)


def bench_decode(ctx: Context) -> tuple[list[Row], dict[str, Any]]:
    s = ctx.sizes
    name = f"batch-1 decode ({s.decode_prompt_len}-token prompt, {s.decode_new_tokens} new)"
    rate = {e: ctx.m(name, "decode tokens/s", e, "tokens/s", True) for e in (KVMESH, HF)}
    ttft = {e: ctx.m(name, "time to first token, ms", e, "ms", False) for e in (KVMESH, HF)}
    checks: dict[str, Any] = {}
    for r in range(ctx.args.rounds):
        prompt = ctx.prompts.make(s.decode_prompt_len)
        runs = {KVMESH: ctx.kv.run([prompt], s.decode_new_tokens)}
        if ctx.hf is not None:
            runs[HF] = ctx.hf.run_single(prompt, s.decode_new_tokens)
        for engine, run in runs.items():
            times = run.token_times_s[0]
            ttft[engine].samples.append(times[0] * 1e3)
            if len(times) > 1:
                rate[engine].samples.append((len(times) - 1) / (times[-1] - times[0]))
            log.info("  round %d %-12s decode %.1f tok/s, ttft %.1f ms", r, engine,
                     rate[engine].samples[-1] if rate[engine].samples else float("nan"), times[0] * 1e3)
        if HF in runs:
            a, b = runs[KVMESH].outputs[0], runs[HF].outputs[0]
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            checks.setdefault("greedy_tokens_matching_prefix", []).append(same)
    rows = [
        Row(name, "decode tokens/s", rate[KVMESH], rate[HF] if ctx.hf else None),
        Row(name, "time to first token, ms", ttft[KVMESH], ttft[HF] if ctx.hf else None),
    ]
    return rows, checks


def bench_concurrent(ctx: Context) -> tuple[list[Row], dict[str, Any]]:
    s = ctx.sizes
    n = s.concurrent_requests
    name = f"{n} concurrent (~{s.concurrent_prompt_len}-token prompts, {s.concurrent_new_tokens} new)"
    metric = "output tokens/s"
    kv = ctx.m(name, metric, KVMESH, "tokens/s", True)
    hf = {b: ctx.m(name, metric, HF, "tokens/s", True) for b in ctx.hf_batch_sizes(n)}
    lengths = jittered_lengths(n, s.concurrent_prompt_len, ctx.args.length_jitter)
    cached = 0
    for r in range(ctx.args.rounds):
        prompts = [ctx.prompts.make(length) for length in lengths]
        run = ctx.kv.run(prompts, s.concurrent_new_tokens)
        cached += run.cached_tokens
        kv.samples.append(run.output_tokens / run.wall_s)
        kv.detail.setdefault("median_ttft_ms", []).append(statistics.median(run.first_token_s) * 1e3)
        log.info("  round %d kvmesh       %.1f tok/s (%.2fs)", r, kv.samples[-1], run.wall_s)
        if ctx.hf is not None:
            for b, m in hf.items():
                hrun = ctx.hf.run_batched(prompts, s.concurrent_new_tokens, b)
                m.samples.append(hrun.output_tokens / hrun.wall_s)
                log.info("  round %d transformers bs=%d %.1f tok/s (%.2fs)", r, b, m.samples[-1], hrun.wall_s)
    best = best_of({f"batch {b}": m for b, m in hf.items()}, label="best") if ctx.hf else None
    note = f"transformers: best of {', '.join(f'bs {b}' for b in hf)} ({best.detail['best']})" if best else ""
    return [Row(name, metric, kv, best, note)], {"concurrent_prompt_lengths": lengths, "concurrent_cached_tokens": cached}


def bench_prefill(ctx: Context) -> tuple[list[Row], dict[str, Any]]:
    s = ctx.sizes
    n = s.prefill_prompts
    name = f"prefill ({n} x {s.prefill_prompt_len}-token prompts, 1 new)"
    metric = "prompt tokens/s"
    kv = ctx.m(name, metric, KVMESH, "tokens/s", True)
    hf = {b: ctx.m(name, metric, HF, "tokens/s", True) for b in sorted({1, n}, reverse=True)}
    cached = 0
    for r in range(ctx.args.rounds):
        prompts = [ctx.prompts.make(s.prefill_prompt_len) for _ in range(n)]
        total = sum(len(p) for p in prompts)
        run = ctx.kv.run(prompts, 1)
        cached += run.cached_tokens
        kv.samples.append(total / run.wall_s)
        log.info("  round %d kvmesh       %.0f tok/s (%.2fs)", r, kv.samples[-1], run.wall_s)
        if ctx.hf is not None:
            for b, m in hf.items():
                wall = ctx.hf.prefill(prompts, b)
                m.samples.append(total / wall)
                log.info("  round %d transformers bs=%d %.0f tok/s (%.2fs)", r, b, m.samples[-1], wall)
    best = best_of({f"batch {b}": m for b, m in hf.items()}, label="best") if ctx.hf else None
    note = f"transformers: one forward per batch, best of batch 1 / {n} ({best.detail['best']})" if best else ""
    return [Row(name, metric, kv, best, note)], {"prefill_cached_tokens": cached}


def bench_shared_prefix(ctx: Context) -> tuple[list[Row], dict[str, Any]]:
    s = ctx.sizes
    n = s.shared_requests
    name = (
        f"shared prefix ({n} x ({s.shared_prefix_len} shared + {s.shared_suffix_len} own), "
        f"{s.shared_new_tokens} new)"
    )
    metric = "wall time, s"
    on = ctx.m(name, metric, KVMESH, "s", False)
    off = ctx.m(name, metric, KVMESH_NO_CACHE, "s", False)
    hf = {b: ctx.m(name, metric, HF, "s", False) for b in ctx.hf_batch_sizes(n)}
    log.info("loading a second kvmesh engine with prefix caching off")
    engine_off = load_kvmesh(ctx.dtype, ctx.args, prefix_caching=False)
    runner_off = KvmeshRunner(engine_off)
    runner_off.run([ctx.prompts.make(48), ctx.prompts.make(40)], 4)  # warm-up
    checks: dict[str, Any] = {"shared_cached_tokens_on": [], "shared_cached_tokens_off": []}
    try:
        for r in range(ctx.args.rounds):
            prefix = ctx.prompts.make(s.shared_prefix_len)
            prompts = [prefix + ctx.prompts.make(s.shared_suffix_len) for _ in range(n)]
            for m, runner, key in ((on, ctx.kv, "on"), (off, runner_off, "off")):
                run = runner.run(prompts, s.shared_new_tokens)
                m.samples.append(run.wall_s)
                checks[f"shared_cached_tokens_{key}"].append(run.cached_tokens)
                log.info("  round %d %-27s %.2fs (%d cached prompt tokens)", r, m.engine, run.wall_s, run.cached_tokens)
            if ctx.hf is not None:
                for b, m in hf.items():
                    hrun = ctx.hf.run_batched(prompts, s.shared_new_tokens, b)
                    m.samples.append(hrun.wall_s)
                    log.info("  round %d transformers bs=%d %.2fs", r, b, hrun.wall_s)
    finally:
        del runner_off, engine_off
        gc.collect()
    best = best_of({f"batch {b}": m for b, m in hf.items()}, label="best") if ctx.hf else None
    speedup = ctx.m(name, "speedup, prefix caching on vs off", KVMESH, "x", True)
    speedup.samples = [b / a for a, b in zip(on.samples, off.samples)]
    hf_note = f"transformers: {best.detail['best']}, no prefix reuse" if best else ""
    rows = [
        Row(name, "wall time, s (prefix caching on)", on, best, hf_note),
        Row(name, "wall time, s (prefix caching off)", off, best, hf_note),
        Row(name, "speedup, caching on vs off", speedup, None, "per-round off/on, median"),
    ]
    return rows, checks


WORKLOADS: dict[str, Callable[[Context], tuple[list[Row], dict[str, Any]]]] = {
    "decode": bench_decode,
    "concurrent": bench_concurrent,
    "prefill": bench_prefill,
    "shared": bench_shared_prefix,
}


def run_dtype(dtype: str, sizes: Sizes, args: argparse.Namespace) -> DtypeResult:
    log.info("=== %s ===", dtype)
    engine = load_kvmesh(dtype, args)
    result = DtypeResult(dtype, engine_config=dataclasses.asdict(engine.config))
    tokenizer = engine.tokenizer
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = engine.eos_token_ids[0]
    hf = None if args.skip_hf else HFRunner(engine.model_dir, dtype, pad)
    ctx = Context(dtype, sizes, args, PromptMaker(tokenizer), KvmeshRunner(engine), hf)
    result.checks["kv_blocks"] = engine.kv_layout.num_blocks
    result.checks["decode_weight_bytes"] = decode_weight_bytes(engine)
    try:
        log.info("warming up")
        warm_up(ctx)
        for key in args.workloads:
            log.info("--- %s (%s) ---", key, dtype)
            rows, checks = WORKLOADS[key](ctx)
            result.rows.extend(rows)
            result.checks.update(checks)
            for row in rows:
                for m in (row.kvmesh, row.hf):
                    if m is not None and m not in result.measurements:
                        result.measurements.append(m)
    finally:
        del ctx, hf, engine
        gc.collect()
    return result


def decode_weight_bytes(engine: LLMEngine) -> int:
    """Bytes of weights a batch-1 decode step reads (every layer, the final norm, the LM head)."""
    c = engine.model_config
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q_size + 2 * kv_size) + q_size * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    params = c.num_layers * per_layer + c.hidden_size + c.vocab_size * c.hidden_size
    return params * engine.kv_layout.itemsize


# ----------------------------------------------------------------------------- machine


def _best_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_machine(sizes: Sizes, repeats: int) -> dict[str, Any]:
    """Memory bandwidth (copy and read) and matmul GFLOP/s, with the benchmark's threads."""
    result: dict[str, Any] = {}
    numel = sizes.bandwidth_mib * 2**20 // 4
    src = torch.rand(numel, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    t = _best_time(lambda dst=dst, src=src: dst.copy_(src), repeats)
    result["copy_gb_s"] = 2 * nbytes / t / 1e9  # read + write
    t = _best_time(lambda src=src: src.sum(), repeats)
    result["read_gb_s"] = nbytes / t / 1e9
    del src, dst
    n = sizes.matmul_n
    result["matmul_n"] = n
    for name, dtype in TORCH_DTYPES.items():
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        t = _best_time(lambda a=a, b=b: torch.mm(a, b), repeats)
        result[f"matmul_{name}_gflop_s"] = 2 * n**3 / t / 1e9
        del a, b
        # What a batch-1 decode step does: one token times a weight matrix far larger than
        # the caches (the float32 copy is bandwidth_mib), so it runs at memory speed at best.
        cols = 4096
        rows = sizes.bandwidth_mib * 2**20 // (4 * cols)
        weight = torch.randn(rows, cols, dtype=dtype)
        x = torch.randn(1, cols, dtype=dtype)
        t = _best_time(lambda x=x, weight=weight: F.linear(x, weight), repeats)
        result[f"matvec_{name}_gb_s"] = weight.numel() * weight.element_size() / t / 1e9
        del weight, x
    result["matvec_shape"] = f"1x{cols} @ ({rows}x{cols})^T"
    gc.collect()
    return result


# ----------------------------------------------------------------------------- reporting


def metadata(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        "command": shlex.join([sys.executable, *argv]),
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": tf_version,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "rounds": args.rounds,
        "quick": args.quick,
        "skip_hf": args.skip_hf,
    }


def _fmt(value: float | None, unit: str) -> str:
    if value is None or value != value:
        return "—"
    if unit == "ms" or unit == "s":
        return f"{value:.2f}" if value < 100 else f"{value:.0f}"
    if unit == "x":
        return f"{value:.2f}×"
    return f"{value:.1f}" if value < 1000 else f"{value:,.0f}"


def ratio(row: Row) -> str:
    """kvmesh's advantage: > 1 means kvmesh is better, whichever way the metric runs."""
    if row.kvmesh is None or row.hf is None:
        return "—"
    a, b = row.kvmesh.median, row.hf.median
    if not a or not b or a != a or b != b:
        return "—"
    return f"{(a / b if row.kvmesh.higher_is_better else b / a):.2f}×"


def dtype_table(result: DtypeResult) -> str:
    lines = [
        f"### {result.dtype}",
        "",
        "| workload | metric | kvmesh | transformers | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    notes = []
    for row in result.rows:
        unit = row.kvmesh.unit if row.kvmesh else row.hf.unit
        lines.append(
            f"| {row.workload} | {row.metric} | {_fmt(row.kvmesh.median if row.kvmesh else None, unit)} | "
            f"{_fmt(row.hf.median if row.hf else None, unit)} | {ratio(row)} |"
        )
        if row.note and row.note not in notes:
            notes.append(row.note)
    lines.append("")
    lines.append("Ratio: kvmesh's advantage (rates: kvmesh / transformers; times: transformers / kvmesh).")
    lines.extend(f"- {n}" for n in notes)
    return "\n".join(lines) + "\n"


def machine_table(machine: dict[str, Any], results: list[DtypeResult]) -> str:
    n = int(machine["matmul_n"])
    lines = [
        "### machine",
        "",
        "| measurement | value |",
        "|---|---:|",
        f"| memory bandwidth, copy (read + write) | {machine['copy_gb_s']:.1f} GB/s |",
        f"| memory bandwidth, read (sum) | {machine['read_gb_s']:.1f} GB/s |",
    ]
    for name in TORCH_DTYPES:
        lines.append(f"| matmul {n}x{n} {name} | {machine[f'matmul_{name}_gflop_s']:.1f} GFLOP/s |")
        lines.append(f"| matrix-vector {machine['matvec_shape']} {name} (weight read rate) | "
                     f"{machine[f'matvec_{name}_gb_s']:.1f} GB/s |")
    for r in results:
        weights = r.checks.get("decode_weight_bytes")
        if weights:
            by_read = machine["read_gb_s"] * 1e9 / weights
            by_matvec = machine[f"matvec_{r.dtype}_gb_s"] * 1e9 / weights
            lines.append(f"| batch-1 decode ceiling, {r.dtype}: {weights / 2**20:.0f} MiB of weights per token "
                         f"at the read bandwidth / at the {r.dtype} matrix-vector rate | "
                         f"{by_read:.0f} / {by_matvec:.0f} tokens/s |")
    return "\n".join(lines) + "\n"


def metadata_block(meta: dict[str, Any]) -> str:
    load = meta.get("load_average_at_start")
    end = meta.get("load_average_at_end")
    return "\n".join([
        f"- command: `{meta['command']}`",
        f"- date: {meta['date_utc']}",
        f"- CPU: {meta['cpu_model']}, {meta['cpu_count']} cores ({meta['cpu_affinity']} usable), "
        f"torch threads {meta['torch_threads']}",
        f"- torch {meta['torch_version']}, transformers {meta['transformers_version']}, "
        f"Python {meta['python_version']}",
        f"- rounds: {meta['rounds']} (median reported)"
        + ("" if meta["skip_hf"] else ", interleaved kvmesh / transformers")
        + (", QUICK sizes (smoke test, not a benchmark)" if meta["quick"] else ""),
        f"- load average at start: {', '.join(f'{x:.2f}' for x in load) if load else 'n/a'}; "
        f"at end: {', '.join(f'{x:.2f}' for x in end) if end else 'n/a'}",
    ]) + "\n"


def markdown_report(meta: dict[str, Any], machine: dict[str, Any] | None, results: list[DtypeResult]) -> str:
    parts = [f"## kvmesh vs transformers, SmolLM2-135M-Instruct, CPU ({meta['date_utc']})", "", metadata_block(meta)]
    for r in results:
        parts.append(dtype_table(r))
    if machine:
        parts.append(machine_table(machine, results))
    return "\n".join(parts)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated: bfloat16,float32")
    p.add_argument("--rounds", type=int, default=None, help="repeats per measurement (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test")
    p.add_argument("--skip-hf", action="store_true", help="measure kvmesh only")
    p.add_argument("--hf-batch-sizes", default="32,8",
                   help="transformers batch sizes for the concurrent and shared-prefix workloads (best reported)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"subset of {','.join(WORKLOADS)}")
    p.add_argument("--skip-machine", action="store_true", help="skip the bandwidth / matmul measurement")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--model", default=None, help="model directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--kv-cache-gib", type=float, default=1.5, help="kvmesh KV budget per engine")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--block-size", type=int, default=None, help="default: the engine's")
    p.add_argument("--length-jitter", type=float, default=0.125,
                   help="concurrent workload prompt lengths spread over mean*(1 +- this)")
    p.add_argument("--out", type=Path, help="write raw numbers and metadata as JSON")
    p.add_argument("--markdown", type=Path, help="append the tables and metadata to this markdown file")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--ablation", action="store_true",
                   help="only the ablation: each optimization off and on in one run; --out gains an 'ablation' key")
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in args.dtypes:
        if d not in TORCH_DTYPES:
            p.error(f"unknown dtype {d!r}; choose from {', '.join(TORCH_DTYPES)}")
    args.hf_batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b.strip()]
    if not args.hf_batch_sizes or min(args.hf_batch_sizes) < 1:
        p.error("--hf-batch-sizes needs positive integers")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


# ----------------------------------------------------------------------------- ablation

ABLATION_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx2", "fma")


def _decode_tokens_per_s(engine: LLMEngine, prompt: list[int], new_tokens: int) -> float:
    """Batch-1 decode rate, from the first generated token to the last (prefill excluded)."""
    engine.add_request(f"abl-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True))
    engine.step()  # prefill and the first token
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return new_tokens / (time.perf_counter() - started)


def _decode_step_ms(engine: LLMEngine, prompts: list[list[int]], steps: int) -> float:
    """Median wall time of one decode step of ``len(prompts)`` sequences (all prefilled first)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abl-{time.monotonic_ns()}-{i}", prompt, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        engine.step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3


ABLATIONS = (  # (name, the LlamaModel attribute that turns it on)
    ("paged decode kernel (K/V read in place)", "paged_kernel"),
    ("fused rotary + K/V store", "fused_rope"),
)


def run_ablation(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    """Each kept optimization off (the others on) and on, in the same engine, rounds
    interleaved (off, on, off, on...), median reported: batch-1 decode tokens/s and the
    32-sequence decode step."""
    quick = args.quick
    new_tokens, steps, batch, prompt_len = (16, 4, 8, 64) if quick else (64, 12, 32, 128)
    results: list[dict[str, Any]] = []
    lines = [
        "| optimization (off: the others still on) | dtype | workload | off | on | on / off |",
        "|---|---|---|---:|---:|---:|",
    ]
    for dtype in args.dtypes:
        engine = load_kvmesh(dtype, args)
        model = engine.model
        prompts = PromptMaker(engine.tokenizer)
        if not model.fused_rope:
            log.warning("ablation: the compiled kernels are not available here; skipping %s", dtype)
            continue
        _decode_tokens_per_s(engine, prompts.make(32), 4)  # warm-up
        for _, attr in ABLATIONS:
            setattr(model, attr, True)  # off: the others still on
        for name, attr in ABLATIONS:
            rates: dict[bool, list[float]] = {False: [], True: []}
            step_ms: dict[bool, list[float]] = {False: [], True: []}
            for round_index in range(args.rounds):
                order = (False, True) if round_index % 2 == 0 else (True, False)  # no order bias
                for flag in order:
                    setattr(model, attr, flag)
                    rates[flag].append(_decode_tokens_per_s(engine, prompts.make(32), new_tokens))
                for flag in order:
                    setattr(model, attr, flag)
                    group = [prompts.make(prompt_len) for _ in range(batch)]
                    step_ms[flag].append(_decode_step_ms(engine, group, steps))
            setattr(model, attr, True)
            for workload, unit, samples, higher in (
                (f"batch-1 decode (32-token prompt, {new_tokens} new)", "tokens/s", rates, True),
                (f"decode step, {batch} sequences of ~{prompt_len}+ tokens", "ms", step_ms, False),
            ):
                off, on = statistics.median(samples[False]), statistics.median(samples[True])
                gain = on / off if higher else off / on
                results.append({"optimization": name, "dtype": dtype, "workload": workload, "unit": unit,
                                "off": samples[False], "on": samples[True], "off_median": off, "on_median": on,
                                "speedup": gain})  # fmt: skip
                lines.append(f"| {name} | {dtype} | {workload} ({unit}) | {off:.1f} | {on:.1f} | {gain:.2f}x faster |")
        del engine, model
        gc.collect()
    flags = set(cpu_flags().split())
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    header = [
        f"### Engine ablation ({dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"- command: `{shlex.join([sys.executable, *sys.argv])}`",
        f"- CPU: {cpu_model()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
        f"flags: {', '.join(f for f in ABLATION_FLAGS if f in flags) or 'none of ' + ', '.join(ABLATION_FLAGS)}",
        f"- load average at the end: {load}; median of {args.rounds} interleaved rounds (off, on, then on, off, ...)",
        "",
    ]
    return results, "\n".join(header + lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else Sizes()
    meta = metadata(args, [sys.argv[0], *argv])
    log.info("sizes: %s", sizes)
    if args.ablation:
        rows, text = run_ablation(args)
        print(text)
        if args.out:
            payload = json.loads(args.out.read_text()) if args.out.exists() else {}
            payload["ablation"] = {"metadata": meta, "cpu_flags": cpu_flags(), "rows": rows}
            args.out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        if args.markdown:
            with args.markdown.open("a", encoding="utf-8") as fh:
                fh.write("\n" + text)
        return 0

    machine = None
    if not args.skip_machine:
        log.info("measuring the machine (bandwidth, matmul)")
        machine = measure_machine(sizes, repeats=3 if args.quick else 5)
        log.info("machine: %s", {k: round(v, 1) if isinstance(v, float) else v for k, v in machine.items()})

    results = []
    for dtype in args.dtypes:
        results.append(run_dtype(dtype, sizes, args))
        gc.collect()

    meta["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    report = markdown_report(meta, machine, results)
    print()
    print(report)
    if args.out:
        payload = {
            "metadata": meta,
            "sizes": dataclasses.asdict(sizes),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": machine,
            "results": [
                {
                    "dtype": r.dtype,
                    "engine_config": r.engine_config,
                    "checks": r.checks,
                    "measurements": [m.to_json() for m in r.measurements],
                    "table": [
                        {"workload": row.workload, "metric": row.metric,
                         "kvmesh": row.kvmesh.median if row.kvmesh else None,
                         "transformers": row.hf.median if row.hf else None,
                         "ratio": ratio(row), "note": row.note}
                        for row in r.rows
                    ],
                }
                for r in results
            ],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        log.info("wrote %s", args.out)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        with args.markdown.open("a", encoding="utf-8") as fh:
            if fh.tell() > 0:
                fh.write("\n")
            fh.write(report)
        log.info("appended to %s", args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
