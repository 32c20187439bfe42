"""Issue 9's targets measured with the servers side by side: every server up at once, the
requests interleaved between them, so that the machine's drift falls on all of them alike.

`benchmarks/vllm_serving_bench.py` measures one server at a time, minutes apart. On a machine
whose speed drifts by 20-40 % over minutes, rows minutes apart cannot settle a 10 % question
(vLLM alone's TTFT p50 went from 440 to 313 ms between two such passes). Here all the named
servers are started first and stay up; then

  ttft          slot by slot, one random prompt (``--input-len`` token ids, fresh for each
                slot so no cache helps) sent to each server in turn, one request at a time
                (concurrency 1), ``--output-len`` tokens forced; the order of the servers
                rotates from slot to slot, so none is always first. Per server TTFT p50 /
                p99; per pair of servers the ratio of p50s and the median of the slot-by-slot
                ratios.
  multi-turn    round by round, the multi-turn chat workload (``--users`` users x ``--turns``
                turns, a shared system prompt, ``--turn-tokens`` new tokens, the users at once)
                on each server in turn, in a rotating order; the system prompt starts with the
                round's number, so no round finds an earlier round's prefix in any cache, and
                every server gets the same conversation within a round. Per server and round
                output tokens/s and the share of prompt tokens served from cache
                (`cached_tokens`); the ratios are taken round by round, the median reported.

An idle server takes next to no CPU (measured: 1-2.5 % a process), but vLLM's server keeps
its worker busy-polling for 1 s after its last step (`SpinCondition` in vLLM's shm_broadcast),
which takes half of a shared core from the next server: ``--gap`` (1.5 s) waits that out
between two requests. The CPU each server's processes used during each phase is recorded, so
a server that did not stay idle shows. Targets (issue 9), for ``--mesh`` against each ``--baseline``: TTFT p50 <= 1.10x,
cached share >= 0.90x, multi-turn output tokens/s >= 0.8x (``--throughput-target``: issue 12
asks 2x of the multi-turn workload with reuse on against off, e.g. ``--servers
mesh-kvmesh,mesh-kvmesh:--no-prefix-caching+--routing-config=benchmarks/routing-load-only.json``;
``--label reuse-off=`` and the second server's full name shows it by that short name in the tables).

    .venv/bin/python benchmarks/vllm_interleaved_bench.py --servers vllm,vllm-1core,mesh-vllm \
        --json docs/benchmarks-vllm-interleaved.json --markdown docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.vllm_interleaved_bench
    import vllm_serving_bench as serving
except ImportError:  # pragma: no cover - depends on how it is imported
    from benchmarks import vllm_serving_bench as serving

logger = logging.getLogger("vllm_interleaved_bench")

SECTION = "vllm-interleaved-bench"


def targets(throughput_ratio: float = serving.TARGET_THROUGHPUT_RATIO) -> list[tuple[str, str, float, str]]:
    """Issue 9's targets as (name, metric, threshold, "le" | "ge"); the throughput ratio is
    an option (issue 12's multi-turn reuse on against off asks for 2x)."""
    return [
        ("TTFT p50 at concurrency 1 <= 1.10x", "ttft", serving.TARGET_TTFT_RATIO, "le"),
        ("multi-turn prompt tokens from cache >= 90 %", "cached_share", serving.TARGET_CACHED_SHARE, "ge"),
        (f"multi-turn output tokens/s >= {throughput_ratio:g}x", "output_tok_s", throughput_ratio, "ge"),
    ]


# ----------------------------------------------------------------------------- pure parts
def rotation(names: Sequence[str], slot: int) -> list[str]:
    """The order of the servers in ``slot``: rotated by one each slot, and reversed every
    other cycle, so over 2 * len(names) slots each server holds each place twice and follows
    each other server as often as it precedes it."""
    count = len(names)
    shift = slot % count
    order = list(names[shift:]) + list(names[:shift])
    return order[::-1] if (slot // count) % 2 else order


def salted_system(round_number: int) -> str:
    """The multi-turn system prompt of a round: its number first, so no round's prefix is
    cached from an earlier round on any server."""
    return f"[session {round_number}] {serving.SYSTEM}"


def steal_share(before: serving.CpuTicks | None, after: serving.CpuTicks | None) -> float | None:
    """The share of CPU time stolen by the hypervisor between two readings."""
    if before is None or after is None or after.total == before.total:
        return None
    return round((after.steal - before.steal) / (after.total - before.total), 4)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass
class Pairing:
    """One server against one baseline on one metric."""

    metric: str
    server: str
    baseline: str
    of_summaries: float | None  # the ratio of the two servers' summaries (p50s, medians)
    per_slot_median: float | None  # the median of the slot-by-slot (round-by-round) ratios
    slots: int


def pair(metric: str, server: str, baseline: str, mine: Sequence[float | None], base: Sequence[float | None],
         summary: float | None, base_summary: float | None) -> Pairing:  # fmt: skip
    """``mine`` and ``base`` are the two servers' values slot by slot (None: that request
    failed); ratios only where both have one."""
    ratios = [m / b for m, b in zip(mine, base, strict=True) if m is not None and b]
    return Pairing(metric, server, baseline, serving.ratio(summary, base_summary), _round(median(ratios), 3), len(ratios))


def summarize_ttft(results: Sequence[serving.RequestResult]) -> dict[str, Any]:
    ttfts = [r.ttft for r in results if r.ok and r.ttft is not None]
    return {
        "requests": len(results),
        "failed": sum(not r.ok for r in results),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "ttft_p50_ms": serving._ms(serving.percentile(ttfts, 0.50)),
        "ttft_p99_ms": serving._ms(serving.percentile(ttfts, 0.99)),
        "ttft_ms": [serving._ms(r.ttft) if r.ok else None for r in results],
    }


def summarize_rounds(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A server's multi-turn rounds (each a WorkloadResult summary): medians over rounds."""
    return {
        "rounds": len(rounds),
        "failed": sum(r["failed"] for r in rounds),
        "output_tok_s": _round(median([r["output_tok_s"] for r in rounds if r["output_tok_s"] is not None])),
        "cached_share": _round(median([r["cached_share"] for r in rounds if r["cached_share"] is not None]), 4),
        "ttft_p50_ms": _round(median([r["ttft_p50_ms"] for r in rounds if r["ttft_p50_ms"] is not None])),
        "per_round": [{k: r[k] for k in ("output_tok_s", "cached_share", "cached_tokens", "prompt_tokens", "ttft_p50_ms", "failed", "seconds")}
                      | {"steal_share": r.get("steal_share")}
                      for r in rounds],
    }  # fmt: skip


def pairings(results: dict[str, dict[str, Any]], mesh: str, baselines: Sequence[str]) -> list[Pairing]:
    out = []
    for base in baselines:
        ttft_m, ttft_b = results.get(mesh, {}).get("ttft"), results.get(base, {}).get("ttft")
        if ttft_m and ttft_b:
            out.append(
                pair("ttft", mesh, base, ttft_m["ttft_ms"], ttft_b["ttft_ms"], ttft_m["ttft_p50_ms"], ttft_b["ttft_p50_ms"])
            )
        turns_m, turns_b = results.get(mesh, {}).get("multi-turn"), results.get(base, {}).get("multi-turn")
        if turns_m and turns_b:
            for metric in ("cached_share", "output_tok_s"):
                mine = [r[metric] for r in turns_m["per_round"]]
                theirs = [r[metric] for r in turns_b["per_round"]]
                out.append(pair(metric, mesh, base, mine, theirs, turns_m[metric], turns_b[metric]))
    return out


def verdicts(found: Sequence[Pairing], throughput_ratio: float = serving.TARGET_THROUGHPUT_RATIO) -> list[dict[str, Any]]:
    """The issue's targets from the pairings: judged on the ratio of the summaries, with the
    median of the slot-by-slot ratios beside it."""
    by_metric = {(p.metric, p.baseline): p for p in found}
    out = []
    for name, metric, threshold, way in targets(throughput_ratio):
        for (found_metric, base), p in by_metric.items():
            if found_metric != metric:
                continue
            measured = p.of_summaries
            met = None if measured is None else (measured <= threshold if way == "le" else measured >= threshold)
            out.append({"target": f"{name} {base}'s", "server": p.server, "baseline": base, "measured": measured,
                        "per_slot_median": p.per_slot_median, "slots": p.slots, "threshold": threshold, "met": met})  # fmt: skip
    return out


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


# ----------------------------------------------------------------------------- the run
class CpuMeter:
    """CPU seconds each server's process tree used between two readings."""

    def __init__(self, servers: dict[str, serving.Server]) -> None:
        self.servers = servers
        self.start = self._ticks()

    def _ticks(self) -> dict[str, int]:
        out = {}
        for name, server in self.servers.items():
            pids = [server.process.pid, *server.children()]
            out[name] = sum(serving.ticks_by_label(pids).values())
        return out

    def seconds(self) -> dict[str, float]:
        now = self._ticks()
        tick = os.sysconf("SC_CLK_TCK")
        return {name: round((now[name] - self.start.get(name, 0)) / tick, 2) for name in now}


async def ttft_phase(servers: dict[str, serving.Server], models: dict[str, str], args: argparse.Namespace,
                     vocab_size: int) -> dict[str, list[serving.RequestResult]]:  # fmt: skip
    prompts = serving.random_prompts(args.slots, args.input_len, vocab_size, seed=2000)
    clients = _clients(servers, args)
    out: dict[str, list[serving.RequestResult]] = {name: [] for name in servers}
    try:
        for slot, prompt in enumerate(prompts):
            for name in rotation(list(servers), slot):
                body = serving.completion_body(models[name], prompt, args.output_len)
                result = await serving.stream_request(clients[name], "/v1/completions", body, args.output_len)
                out[name].append(result)
                await asyncio.sleep(args.gap)  # the last server back to idle (vLLM's worker spins for 1 s after a step)
            logger.info("ttft slot %d: %s", slot, {n: serving._ms(rs[-1].ttft) for n, rs in out.items()})
    finally:
        await asyncio.gather(*(c.aclose() for c in clients.values()))
    return out


async def multi_turn_phase(
    servers: dict[str, serving.Server], models: dict[str, str], args: argparse.Namespace
) -> dict[str, list[dict[str, Any]]]:
    clients = _clients(servers, args)
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    try:
        for number in range(args.rounds):
            for name in rotation(list(servers), number):
                before = serving.cpu_ticks()
                result = await serving.multi_turn(
                    clients[name], models[name], args.users, args.turns, args.turn_tokens, system=salted_system(number)
                )
                out[name].append(result.summary() | {"steal_share": steal_share(before, serving.cpu_ticks())})
                logger.info("multi-turn round %d %s: %s", number, name, out[name][-1])
                await asyncio.sleep(args.gap)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients.values()))
    return out


def serve_phase(servers: dict[str, serving.Server], args: argparse.Namespace) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """`vllm bench serve` (random ``--serve-input-len`` in / ``--serve-output-len`` out) round by
    round, each concurrency on every server in turn, rotating the order."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {name: {} for name in servers}
    slot = 0
    for number in range(args.serve_rounds):
        for concurrency in args.serve_concurrency:
            one = argparse.Namespace(**{**vars(args), "bench_serve_concurrency": [concurrency], "input_len": args.serve_input_len,
                                        "output_len": args.serve_output_len})  # fmt: skip
            for name in rotation(list(servers), slot):
                before = serving.cpu_ticks()
                found = serving.bench_serve(servers[name], one, servers[name].workdir)
                row = found[f"random-c{concurrency}"] | {"steal_share": steal_share(before, serving.cpu_ticks())}
                out[name].setdefault(f"c{concurrency}", []).append(row)
                logger.info("serve round %d c=%d %s: %s", number, concurrency, name, found)
                time.sleep(args.gap)
            slot += 1
    return out


def summarize_serve(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A server's `vllm bench serve` rounds at one concurrency: medians over the rounds that ran."""
    ran = [r for r in rounds if "error" not in r]
    return {
        "rounds": len(rounds),
        "errors": [r["error"][-300:] for r in rounds if "error" in r],
        "failed": sum(r.get("failed") or 0 for r in ran),
        "output_tok_s": _round(median([r["output_tok_s"] for r in ran if r.get("output_tok_s") is not None])),
        "ttft_p50_ms": _round(median([r["ttft_p50_ms"] for r in ran if r.get("ttft_p50_ms") is not None])),
        "itl_p50_ms": _round(median([r["itl_p50_ms"] for r in ran if r.get("itl_p50_ms") is not None])),
        "per_round": [
            {
                k: r.get(k)
                for k in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "failed", "seconds", "cpu_seconds", "steal_share")
            }
            for r in rounds
        ],
    }


def serve_pairings(results: dict[str, dict[str, Any]], baseline: str) -> list[Pairing]:
    """Every other server's `vllm bench serve` output tokens/s against ``baseline``'s, each concurrency."""
    out = []
    for name, mine in results.items():
        if name == baseline:
            continue
        for key, summary in mine.get("serve", {}).items():
            base = results.get(baseline, {}).get("serve", {}).get(key)
            if base:
                out.append(pair(f"serve-{key}", name, baseline, [r["output_tok_s"] for r in summary["per_round"]],
                                [r["output_tok_s"] for r in base["per_round"]], summary["output_tok_s"], base["output_tok_s"]))  # fmt: skip
    return out


def _clients(servers: dict[str, serving.Server], args: argparse.Namespace) -> dict[str, httpx.AsyncClient]:
    return {
        name: httpx.AsyncClient(base_url=s.base_url, timeout=httpx.Timeout(args.request_timeout), trust_env=False)
        for name, s in servers.items()
    }


async def warm_up(servers: dict[str, serving.Server], models: dict[str, str], args: argparse.Namespace, vocab_size: int) -> None:
    clients = _clients(servers, args)
    try:
        for name, client in clients.items():  # first requests pay one-time costs
            await serving.random_load(
                client, models[name], "warm-up", serving.random_prompts(2, args.input_len, vocab_size, seed=999), 4, 2
            )
    finally:
        await asyncio.gather(*(c.aclose() for c in clients.values()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvmesh.engine.loader.default_model import resolve_model

    model_dir = resolve_model(None)  # converted once here, before any server starts
    vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    servers: dict[str, serving.Server] = {}
    phases: dict[str, Any] = {"servers": {}}
    try:
        for name in args.servers:
            label, start = serving.server_start(name, args)
            workdir = Path(tempfile.mkdtemp(prefix=f"kvmesh-interleaved-{serving.file_stem(name)}-"))
            logger.info("%s: starting `%s`", name, label)
            servers[name] = start(args, workdir)
            phases["servers"][name] = {"server": label, "command": " ".join(servers[name].command),
                                       "start_seconds": round(servers[name].started_s, 1), "logs": str(workdir)}  # fmt: skip
        models = {name: serving.served_model(s.base_url) for name, s in servers.items()}
        asyncio.run(warm_up(servers, models, args, vocab_size))
        phases["machine_all_up_idle"] = serving.machine_state()
        results: dict[str, dict[str, Any]] = {name: {} for name in servers}
        if args.slots > 0:
            meter = CpuMeter(servers)
            began = time.monotonic()
            ttfts = asyncio.run(ttft_phase(servers, models, args, vocab_size))
            phases["ttft"] = {"seconds": round(time.monotonic() - began, 1), "cpu_seconds_by_server": meter.seconds()}
            for name, found in ttfts.items():
                results[name]["ttft"] = summarize_ttft(found)
        if args.rounds > 0 and args.users > 0:
            meter = CpuMeter(servers)
            began = time.monotonic()
            turns = asyncio.run(multi_turn_phase(servers, models, args))
            phases["multi-turn"] = {"seconds": round(time.monotonic() - began, 1), "cpu_seconds_by_server": meter.seconds()}
            for name, rounds in turns.items():
                results[name]["multi-turn"] = summarize_rounds(rounds)
        if args.serve_rounds > 0 and args.serve_concurrency:
            meter = CpuMeter(servers)
            began = time.monotonic()
            served = serve_phase(servers, args)
            phases["serve"] = {"seconds": round(time.monotonic() - began, 1), "cpu_seconds_by_server": meter.seconds()}
            for name, by_concurrency in served.items():
                results[name]["serve"] = {key: summarize_serve(rounds) for key, rounds in by_concurrency.items()}
    finally:
        for name, server in servers.items():
            phases["servers"][name]["killed_leftovers"] = server.stop()
            logger.info("%s: stopped", name)
    found = pairings(results, args.mesh, [b for b in args.baselines if b in results])
    return {
        "phases": phases,
        "results": results,
        "pairings": [vars(p) for p in found],
        "serve_pairings": [vars(p) for p in serve_pairings(results, args.baselines[0])] if args.baselines else [],
        "targets": verdicts(found, args.throughput_target),
    }


# ----------------------------------------------------------------------------- report
def round_text(found: dict[str, Any]) -> str:
    """A round's output tokens/s, with the share of CPU the hypervisor stole during it when
    that was 1 % or more."""
    text = serving._fmt(found.get("output_tok_s"))
    steal = found.get("steal_share")
    return text + (f" (steal {100 * steal:.0f} %)" if steal is not None and steal >= 0.01 else "")


def table(header: Sequence[str], align: str, rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table's lines and the blank line after it; ``align`` has a letter a column,
    ``r`` for a right-aligned one."""
    return ["| " + " | ".join(header) + " |", "|" + "".join("---:|" if a == "r" else "---|" for a in align),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows), ""]  # fmt: skip


def markdown(payload: dict[str, Any]) -> str:
    meta, report, c = payload["machine"], payload["report"], payload["config"]
    fmt = serving._fmt
    labels: dict[str, str] = c.get("labels") or {}

    def shown(name: str) -> str:
        return labels.get(name, name)

    flags = f"AVX-512: {'yes' if meta['avx512'] else 'no'}, AVX-512-BF16: {'yes' if meta['avx512_bf16'] else 'no'}, AMX: {'yes' if meta['amx'] else 'no'}"
    smoke = " — SMOKE RUN" if c.get("quick") else ""
    lines = [
        f"## {c.get('title') or 'Issue 9 targets, the servers side by side, requests interleaved'} ({payload['date']}){smoke}",
        "",
        f"Command: `{payload['command']}`  ",
        f"Machine: {meta['cpu']}, {meta['cores']} cores ({flags}); vLLM {meta.get('vllm')} (torch {meta.get('torch_vllm_venv')}), "
        f"kvmesh {meta.get('kvmesh_commit')} (torch {meta.get('torch_kvmesh_venv')}), {c['dtype']}  ",
        "Servers, all up at once: " + "; ".join(f"`{shown(n)}` {p['server']} (started in {p['start_seconds']} s)" for n, p in report["phases"]["servers"].items()),
        "",
    ]  # fmt: skip
    results = report["results"]
    if any("ttft" in r for r in results.values()):
        lines += [f"**TTFT at concurrency 1**: {c['slots']} slots, each one fresh {c['input_len']}-token random prompt sent to every "
                  f"server in turn (rotating order), {c['output_len']} tokens forced.", ""]  # fmt: skip
        lines += table(("server", "requests", "failed", "TTFT p50 (ms)", "TTFT p99 (ms)"), "lrrrr",
                       [(shown(name), t["requests"], t["failed"], fmt(t["ttft_p50_ms"]), fmt(t["ttft_p99_ms"]))
                        for name, r in results.items() if (t := r.get("ttft"))])  # fmt: skip
    if any("multi-turn" in r for r in results.values()):
        lines += [f"**Multi-turn chat**: {c['rounds']} rounds, each {c['users']} users x {c['turns']} turns of {c['turn_tokens']} new tokens "
                  "on every server in turn (rotating order), a system prompt of the round's own; a round's CPU share stolen by the "
                  "hypervisor is shown when 1 % or more.", ""]  # fmt: skip
        lines += table(("server", "rounds", "failed", "output tok/s (median)", "cached share (median)", "TTFT p50 (ms, median)",
                        "output tok/s by round"), "lrrrrrl",
                       [(shown(name), m["rounds"], m["failed"], fmt(m["output_tok_s"]),
                         "—" if m["cached_share"] is None else f"{100 * m['cached_share']:.1f} %", fmt(m["ttft_p50_ms"]),
                         ", ".join(round_text(x) for x in m["per_round"]))
                        for name, r in results.items() if (m := r.get("multi-turn"))])  # fmt: skip
    if any("serve" in r for r in results.values()):
        lines += [f"**`vllm bench serve`**: {c['serve_rounds']} rounds, each random {c['serve_input_len']} in / {c['serve_output_len']} out "
                  "(--ignore-eos) at each concurrency on every server in turn (rotating order); the prompts of a row as "
                  "vllm_serving_bench's bench-serve mode sends them.", ""]  # fmt: skip
        lines += table(("server", "concurrency", "failed", "output tok/s (median)", "by round", "TTFT p50 (ms, median)",
                        "ITL p50 (ms, median)"), "lrrrlrr",
                       [(shown(name), key[1:], f"{v['failed']}{' + errors' if v['errors'] else ''}", fmt(v["output_tok_s"]),
                         ", ".join(round_text(x) for x in v["per_round"]), fmt(v["ttft_p50_ms"]), fmt(v["itl_p50_ms"]))
                        for name, r in results.items() for key, v in r.get("serve", {}).items()])  # fmt: skip
        if report.get("serve_pairings"):
            lines += table((f"server against `{shown(report['serve_pairings'][0]['baseline'])}`", "concurrency",
                            "output tok/s, of the medians", "median of round ratios", "rounds"), "lrrrr",
                           [(shown(p["server"]), p["metric"].removeprefix("serve-c"), f"{fmt(p['of_summaries'], 3)}×",
                             f"{fmt(p['per_slot_median'], 3)}×", p["slots"]) for p in report["serve_pairings"]])  # fmt: skip
    if report["targets"]:
        rows = []
        for t in report["targets"]:
            met = "not measured" if t["met"] is None else ("met" if t["met"] else "missed")
            met += " (smoke run: no verdict)" if c.get("quick") and t["met"] is not None else ""
            measured = "—" if t["measured"] is None else f"{t['measured']:.3f}×"
            per_slot = "—" if t["per_slot_median"] is None else f"{t['per_slot_median']:.3f}×"
            target = t["target"].removesuffix(f" {t['baseline']}'s") + f" {shown(t['baseline'])}'s"  # verdicts' name, labelled
            rows.append((target, measured, per_slot, t["slots"], met))
        lines += table((f"target (`{shown(c['mesh'])}` against each)", "of the summaries", "median of slot ratios", "slots", "met?"),
                       "lrrrl", rows)  # fmt: skip
    cpu = "; ".join(f"{phase}: " + ", ".join(f"{shown(n)} {s:.1f}" for n, s in report["phases"][phase]["cpu_seconds_by_server"].items())
                    + f" (of {report['phases'][phase]['seconds']} s)" for phase in ("ttft", "multi-turn", "serve") if phase in report["phases"])  # fmt: skip
    idle = report["phases"].get("machine_all_up_idle", {})
    lines.append(f"CPU seconds each server's processes used, by phase: {cpu}. With all servers up and idle: load average "
                 f"{idle.get('load_average')}, CPU busy over 3 s {fmt(idle.get('cpu_busy_3s'), 2)}.")  # fmt: skip
    for note in payload.get("notes") or []:
        lines += ["", note]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main
def label_option(text: str) -> tuple[str, str]:
    """``--label NAME=SERVER`` as (server, name); the server's name may hold "=" itself."""
    name, _, server = text.partition("=")
    if not name or not server:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=SERVER")
    return server, name


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--servers",
        type=lambda s: [x for x in s.split(",") if x],
        default=["vllm", "vllm-1core", "mesh-vllm"],
        help=f"at least two of {', '.join(serving.SERVER_STARTS)} (or a mesh server with flags, as vllm_serving_bench takes)",
    )
    p.add_argument("--mesh", default="mesh-vllm", help="the server the targets are for")
    p.add_argument("--baselines", type=lambda s: [x for x in s.split(",") if x], default=["vllm", "vllm-1core"])
    p.add_argument(
        "--vllm-python", default=None, help="the Python of a virtualenv with vLLM (default: $KVMESH_VLLM_PYTHON or .venv-vllm)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache of vLLM alone and of each mesh worker")
    p.add_argument("--slots", type=int, default=24, help="TTFT slots (one request to each server per slot); 0: none")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument(
        "--rounds", type=int, default=3, help="multi-turn rounds (the whole workload on each server per round); 0: none"
    )
    p.add_argument("--users", type=int, default=10)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--turn-tokens", type=int, default=50)
    p.add_argument(
        "--throughput-target",
        type=float,
        default=serving.TARGET_THROUGHPUT_RATIO,
        help="the multi-turn output tokens/s ratio asked for (issue 9: 0.8 against vLLM; issue 12: 2 for reuse on against off)",
    )
    p.add_argument(
        "--serve-concurrency",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[],
        help="`vllm bench serve` at these concurrencies (issue 12's serving table: 1,8,32); default none",
    )
    p.add_argument("--serve-rounds", type=int, default=2)
    p.add_argument("--serve-input-len", type=int, default=128)
    p.add_argument("--serve-output-len", type=int, default=128)
    p.add_argument("--bench-serve-prompts-c1", type=int, default=8, help="bench-serve prompts at concurrency 1")
    p.add_argument(
        "--bench-serve-prompts", type=int, default=16, help="bench-serve prompts at each other concurrency (at least 2x it)"
    )
    p.add_argument("--gap", type=float, default=1.5, help="seconds between two servers' requests: longer than vLLM's server "
                   "busy-polls after its last step (1 s, `SpinCondition` in vLLM's shm_broadcast), which would take a shared core "
                   "from the next server")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 2 slots of 4 tokens, 1 round of 2 users x 2 turns of 8 tokens"
    )
    p.add_argument("--baseline-tree", type=Path, help="another checkout, with its own .venv and .venv-vllm, for the servers "
                   "named NAME@base (say mesh-prefill0@base): the code before a change, in the same run")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the raw results here")
    p.add_argument("--markdown", type=Path, help="replace (or append) this script's delimited section of this file")
    p.add_argument("--section", default=SECTION, help="the markdown section's marker name")
    p.add_argument("--title", help="the markdown section's title")
    p.add_argument("--label", dest="labels", type=label_option, action="append", default=[], metavar="NAME=SERVER",
                   help="show SERVER as NAME in the markdown (the raw results keep its full name); repeatable, "
                   "also with --render")  # fmt: skip
    p.add_argument(
        "--render", type=Path, metavar="JSON", help="run nothing: render the section from a results file written by --json"
    )
    args = p.parse_args(argv)
    args.vllm_python = args.vllm_python or serving.default_vllm_python()
    args.baseline_python = None  # server_start's option for a server this script does not take
    if len(args.servers) < 2 or len(set(args.servers)) != len(args.servers):
        p.error("--servers: at least two, each once")
    unknown = [
        n
        for n in args.servers
        if n not in serving.SERVER_STARTS
        and not (n.partition(":")[0] in serving.MESH_FLAGS and n.partition(":")[2])
        and not (args.baseline_tree and n.removesuffix(serving.BASELINE) in serving.MESH_FLAGS)
    ]
    if unknown:
        p.error(f"--servers: unknown {', '.join(unknown)}")
    based = [n for n in args.servers if n.endswith(serving.BASELINE)]
    if based and not args.baseline_tree:
        p.error(f"--servers {', '.join(based)}: these need --baseline-tree")
    if args.mesh not in args.servers:
        p.error(f"--mesh {args.mesh} is not among --servers")
    args.baselines = [b for b in args.baselines if b in args.servers]
    labels = dict(args.labels)
    if len(labels) != len(args.labels) or len(set(labels.values())) != len(labels):
        p.error("--label: each server once, each name once")
    unknown = [] if args.render else [s for s in labels if s not in args.servers]
    if unknown:
        p.error(f"--label: not among --servers: {', '.join(unknown)}")
    args.labels = labels
    if args.quick:
        args.slots, args.output_len, args.rounds, args.users, args.turns, args.turn_tokens = 2, 4, 1, 2, 2, 8
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.render:
        payload = json.loads(args.render.read_text())
        payload["config"]["labels"] = (payload["config"].get("labels") or {}) | args.labels
    else:
        began = time.monotonic()
        payload = {
            "command": " ".join([serving._repo_relative(sys.executable), serving._repo_relative(__file__), *argv]),
            "date": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            "machine": serving.machine_info(args.vllm_python),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        }
        payload["report"] = run(args)
        payload["seconds"] = round(time.monotonic() - began, 1)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")
            logger.info("wrote %s", args.json)
    section = markdown(payload)
    print(section)
    if args.markdown:
        document = args.markdown.read_text() if args.markdown.exists() else ""
        args.markdown.write_text(serving.replace_section(document, section, args.section))
        logger.info("updated %s", args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
