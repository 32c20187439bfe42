"""The pure parts of benchmarks/vllm_interleaved_bench.py: the servers' rotating order, the
salted rounds, the slot-by-slot pairing, the targets and the markdown section; no servers."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from benchmarks.vllm_interleaved_bench import main, markdown, pairings, parse_args, rotation, salted_system, summarize_rounds, summarize_ttft, verdicts
from benchmarks.vllm_serving_bench import RequestResult


def test_rotation_puts_each_server_in_each_place_and_after_each_other():
    names = ["a", "b", "c"]
    orders = [rotation(names, slot) for slot in range(2 * len(names))]
    assert orders[0] == ["a", "b", "c"] and orders[1] == ["b", "c", "a"] and orders[3] == ["c", "b", "a"]
    for place in range(3):
        assert Counter(order[place] for order in orders) == {"a": 2, "b": 2, "c": 2}
    follows = Counter((order[i], order[i + 1]) for order in orders for i in range(2))
    assert follows[("a", "b")] == follows[("b", "a")]
    assert rotation(["x", "y"], 0) == ["x", "y"] and rotation(["x", "y"], 1) == ["y", "x"]


def test_each_round_has_a_system_prompt_of_its_own():
    assert salted_system(0) != salted_system(1)
    assert salted_system(0).startswith("[session 0] ")


def _ttft(*seconds: float | None) -> list[RequestResult]:
    return [RequestResult(ok=s is not None, ttft=s, error=None if s is not None else "boom") for s in seconds]


def _round(share: float, tok_s: float) -> dict:
    return {"output_tok_s": tok_s, "cached_share": share, "cached_tokens": int(share * 100), "prompt_tokens": 100,
            "ttft_p50_ms": 10.0, "failed": 0, "seconds": 1.0}  # fmt: skip


def test_pairings_ratio_the_summaries_and_the_slots_and_judge_the_targets():
    results = {
        "mesh": {"ttft": summarize_ttft(_ttft(0.110, 0.220, None, 0.105)),
                 "multi-turn": summarize_rounds([_round(0.8, 90.0), _round(0.8, 100.0), _round(0.8, 120.0)])},
        "base": {"ttft": summarize_ttft(_ttft(0.100, 0.200, 0.300, 0.100)),
                 "multi-turn": summarize_rounds([_round(0.8, 100.0), _round(0.8, 100.0), _round(0.8, 100.0)])},
    }  # fmt: skip
    assert results["mesh"]["ttft"]["failed"] == 1 and results["mesh"]["ttft"]["ttft_ms"][2] is None
    assert results["mesh"]["ttft"]["ttft_p50_ms"] == 110.0  # of the three that came
    found = {p.metric: p for p in pairings(results, "mesh", ["base"])}
    ttft = found["ttft"]
    assert ttft.slots == 3  # the failed slot pairs with nothing
    assert ttft.per_slot_median == pytest.approx(1.1)  # ratios 1.1, 1.1, 1.05
    assert ttft.of_summaries == pytest.approx(110.0 / 150.0, abs=1e-3)  # p50 of 100, 100, 200, 300
    assert found["output_tok_s"].per_slot_median == pytest.approx(1.0) and found["output_tok_s"].slots == 3
    assert found["cached_share"].of_summaries == pytest.approx(1.0)
    judged = {t["target"]: t for t in verdicts(list(found.values()))}
    assert judged["TTFT p50 at concurrency 1 <= 1.10x base's"]["met"] is True
    assert judged["multi-turn prompt tokens from cache >= 90 % base's"]["met"] is True
    assert judged["multi-turn output tokens/s >= 0.8x base's"]["met"] is True
    slow = {"mesh": {"ttft": summarize_ttft(_ttft(0.5, 0.5))}, "base": {"ttft": summarize_ttft(_ttft(0.1, 0.1))}}
    (only,) = verdicts(pairings(slow, "mesh", ["base"]))
    assert only["met"] is False and only["measured"] == pytest.approx(5.0)


def _payload(**config: object) -> dict:
    results = {"mesh": {"ttft": summarize_ttft(_ttft(0.11, 0.12)), "multi-turn": summarize_rounds([_round(0.8, 90.0)])},
               "base": {"ttft": summarize_ttft(_ttft(0.10, 0.10)), "multi-turn": summarize_rounds([_round(0.8, 100.0)])}}  # fmt: skip
    found = pairings(results, "mesh", ["base"])
    return {
        "command": "x", "date": "2026-12-03 14:00 UTC",
        "machine": {"cpu": "Test CPU", "cores": 2, "avx512": True, "avx512_bf16": False, "amx": False, "vllm": "0.32.0"},
        "config": {"dtype": "float32", "slots": 2, "input_len": 128, "output_len": 32, "rounds": 1, "users": 10, "turns": 5,
                   "turn_tokens": 50, "mesh": "mesh", "quick": False, **config},
        "report": {"phases": {"servers": {"mesh": {"server": "kvmesh up", "start_seconds": 9.0}, "base": {"server": "vllm", "start_seconds": 60.0}},
                              "ttft": {"seconds": 5.0, "cpu_seconds_by_server": {"mesh": 1.0, "base": 1.0}},
                              "machine_all_up_idle": {"load_average": [0.1, 0.1, 0.1], "cpu_busy_3s": 0.01}},
                   "results": results, "pairings": [vars(p) for p in found], "targets": verdicts(found)},
    }  # fmt: skip


def test_markdown_shows_the_tables_and_the_verdicts():
    text = markdown(_payload())
    assert "Test CPU, 2 cores (AVX-512: yes, AVX-512-BF16: no, AMX: no)" in text
    assert "| mesh | 2 | 0 | 115.0 | 119.9 |" in text
    assert "| TTFT p50 at concurrency 1 <= 1.10x base's | 1.150× | 1.150× | 2 | missed |" in text
    assert "| multi-turn output tokens/s >= 0.8x base's | 0.900× | 0.900× | 1 | met |" in text
    assert "ttft: mesh 1.0, base 1.0 (of 5.0 s)" in text


def test_labels_shorten_the_servers_names_in_the_markdown_only(tmp_path, capsys):
    long = "mesh-kvmesh:--no-prefix-caching+--routing-config=/x.json"
    args = parse_args(["--vllm-python", "/x", "--servers", f"mesh-kvmesh,{long}", "--mesh", "mesh-kvmesh", "--baselines", long,
                       "--label", f"off={long}", "--label", "on=mesh-kvmesh"])  # fmt: skip
    assert args.labels == {long: "off", "mesh-kvmesh": "on"}  # split at the first "=": the server's name keeps its own
    for bad in (["--label", "off"], ["--label", "=vllm"], ["--label", "a=vllm", "--label", "b=vllm"],
                ["--label", "a=vllm", "--label", "a=mesh-vllm"], ["--label", "a=mesh-kvmesh"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(["--vllm-python", "/x", *bad])
    payload = _payload(labels={"mesh": "short", "base": "b"})
    text = markdown(payload)
    assert "| short | 2 | 0 | 115.0 | 119.9 |" in text and "| b | 2 | 0 | 100.0 | 100.0 |" in text
    assert "Servers, all up at once: `short` kvmesh up (started in 9.0 s); `b` vllm" in text
    assert "| target (`short` against each) |" in text
    assert "| TTFT p50 at concurrency 1 <= 1.10x b's | 1.150× | 1.150× | 2 | missed |" in text
    assert "ttft: short 1.0, b 1.0 (of 5.0 s)" in text
    assert "| mesh |" not in text and "| base |" not in text
    assert set(payload["report"]["results"]) == {"mesh", "base"}  # the raw results keep the full names
    assert payload["report"]["targets"][0]["baseline"] == "base" and payload["report"]["targets"][0]["target"].endswith(" base's")
    stored = tmp_path / "results.json"  # --render takes labels too, over the file's own
    stored.write_text(json.dumps(_payload(labels={"base": "b"})))
    assert main(["--vllm-python", "/x", "--render", str(stored), "--label", "short=mesh"]) == 0
    rendered = capsys.readouterr().out
    assert "| short | 2 | 0 | 115.0 | 119.9 |" in rendered and "| b | 2 | 0 | 100.0 | 100.0 |" in rendered


def test_arguments():
    args = parse_args(["--vllm-python", "/x"])
    assert args.servers == ["vllm", "vllm-1core", "mesh-vllm"] and args.mesh == "mesh-vllm"
    with pytest.raises(SystemExit):
        parse_args(["--vllm-python", "/x", "--servers", "vllm"])  # nothing to interleave with
    with pytest.raises(SystemExit):
        parse_args(["--vllm-python", "/x", "--servers", "vllm,nonsense"])
    with pytest.raises(SystemExit):
        parse_args(["--vllm-python", "/x", "--servers", "vllm,vllm-1core"])  # the mesh is not among them
    quick = parse_args(["--vllm-python", "/x", "--quick", "--servers", "vllm-1core,mesh-vllm:--local-prefill-max-tokens=0", "--mesh",
                        "mesh-vllm:--local-prefill-max-tokens=0"])  # fmt: skip
    assert quick.slots == 2 and quick.rounds == 1
    with pytest.raises(SystemExit):  # the code before, with flags, but no tree to take it from
        parse_args(["--vllm-python", "/x", "--servers", "mesh-kvmesh,mesh-kvmesh:--lend-cores@base", "--mesh", "mesh-kvmesh"])
    based = parse_args(["--vllm-python", "/x", "--servers", "mesh-kvmesh,mesh-kvmesh:--lend-cores@base", "--mesh", "mesh-kvmesh",
                        "--baseline-tree", "/tmp"])  # fmt: skip
    assert based.servers == ["mesh-kvmesh", "mesh-kvmesh:--lend-cores@base"]


def test_serve_rounds_are_summarized_and_paired_with_the_baseline():
    from benchmarks.vllm_interleaved_bench import serve_pairings, summarize_serve

    def row(tok_s: float, failed: int = 0) -> dict:
        return {"output_tok_s": tok_s, "ttft_p50_ms": 100.0, "itl_p50_ms": 50.0, "failed": failed, "seconds": 10.0, "cpu_seconds": {}}

    mesh = summarize_serve([row(110.0), row(90.0, failed=1), {"error": "x" * 400}])
    assert mesh["rounds"] == 3 and mesh["failed"] == 1 and mesh["output_tok_s"] == 100.0 and len(mesh["errors"][0]) == 300
    results = {"vllm": {"serve": {"c32": summarize_serve([row(100.0), row(100.0)])}},
               "mesh": {"serve": {"c32": summarize_serve([row(110.0), row(90.0)])}}}  # fmt: skip
    (only,) = serve_pairings(results, "vllm")
    assert only.metric == "serve-c32" and only.server == "mesh" and only.slots == 2
    assert only.of_summaries == pytest.approx(1.0) and only.per_slot_median == pytest.approx(1.0)


def test_steal_share_and_a_rounds_text():
    from benchmarks.vllm_interleaved_bench import round_text, steal_share
    from benchmarks.vllm_serving_bench import CpuTicks, cpu_ticks

    assert steal_share(CpuTicks(100, 50, 5), CpuTicks(200, 60, 15)) == 0.1
    assert steal_share(None, CpuTicks(200, 60, 15)) is None and steal_share(CpuTicks(100, 50, 5), CpuTicks(100, 50, 5)) is None
    now = cpu_ticks() or CpuTicks(0, 0, 0)
    assert now.total >= now.idle + now.steal and now.idle >= 0 and now.steal >= 0
    assert round_text({"output_tok_s": 66.71, "steal_share": 0.004}) == "66.7"
    assert round_text({"output_tok_s": 29.9, "steal_share": 0.25}) == "29.9 (steal 25 %)"
    assert round_text({"output_tok_s": 50.0}) == "50.0"
