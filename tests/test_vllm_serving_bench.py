"""The pure parts of benchmarks/vllm_serving_bench.py: percentiles, SSE parsing into request
results, cached-token accounting, the issue's targets and the markdown section; no servers."""

from __future__ import annotations

import json

import pytest

from benchmarks.vllm_serving_bench import (
    DONE,
    RequestResult,
    StreamReader,
    WorkloadResult,
    evaluate_bench_serve_targets,
    evaluate_targets,
    markdown,
    merge_json,
    event_text,
    parse_sse_line,
    percentile,
    random_prompts,
    replace_section,
)


def test_percentile_interpolates_like_numpy():
    assert percentile([], 0.5) is None
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert percentile([0.0, 10.0], 0.99) == pytest.approx(9.9)
    assert percentile([1.0, 2.0, 3.0], 0.0) == 1.0 and percentile([1.0, 2.0, 3.0], 1.0) == 3.0


def test_parse_sse_line():
    assert parse_sse_line("data: [DONE]") is DONE
    assert parse_sse_line('data: {"a": 1}\r') == {"a": 1}
    assert parse_sse_line('data:{"a": 2}') == {"a": 2}
    assert parse_sse_line("") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("event: message") is None
    with pytest.raises(json.JSONDecodeError):
        parse_sse_line("data: {not json")


def test_event_text_chat_and_completions():
    assert event_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert event_text({"choices": [{"delta": {"content": "Hi"}}]}) == "Hi"
    assert event_text({"choices": [{"text": " there"}]}) == " there"
    assert event_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def _chunk(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text}]})


def test_stream_reader_times_usage_and_cached_tokens():
    reader = StreamReader(started=10.0)
    reader.feed("data: " + json.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]}), 10.05)  # no content
    reader.feed(_chunk("a"), 10.2)
    reader.feed("", 10.21)
    reader.feed(_chunk("b"), 10.3)
    reader.feed(_chunk("c"), 10.5)
    usage = {"prompt_tokens": 100, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 64}}
    reader.feed("data: " + json.dumps({"choices": [], "usage": usage}), 10.5)
    reader.feed("data: [DONE]", 10.6)
    r = reader.finish(10.6, expected_tokens=3)
    assert r.ok and r.error is None
    assert r.ttft == pytest.approx(0.2)
    assert r.itls == pytest.approx([0.1, 0.2])
    assert r.latency == pytest.approx(0.6)
    assert (r.prompt_tokens, r.cached_tokens, r.output_tokens, r.text) == (100, 64, 3, "abc")


def test_stream_reader_failures():
    no_done = StreamReader(0.0)
    no_done.feed(_chunk("x"), 0.1)
    assert no_done.finish(0.2).error == "the stream ended without [DONE]"

    error_event = StreamReader(0.0)
    error_event.feed(_chunk("x"), 0.1)
    error_event.feed("data: " + json.dumps({"error": {"message": "worker lost", "type": "server_error"}}), 0.2)
    error_event.feed("data: [DONE]", 0.3)
    assert error_event.finish(0.3).error == "worker lost" and not error_event.result.ok

    short = StreamReader(0.0)
    short.feed(_chunk("x"), 0.1)
    short.feed("data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}), 0.1)
    short.feed("data: [DONE]", 0.2)
    assert short.finish(0.2, expected_tokens=4).error == "1 output tokens, not 4"

    nothing = StreamReader(0.0)
    nothing.feed("data: [DONE]", 0.1)
    assert nothing.finish(0.1).error == "no token came"

    no_details = StreamReader(0.0)  # a server without prompt_tokens_details: 0 cached
    no_details.feed(_chunk("x"), 0.1)
    no_details.feed("data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}), 0.1)
    no_details.feed("data: [DONE]", 0.2)
    assert no_details.finish(0.2).cached_tokens == 0


def test_workload_summary_counts_only_successful_requests():
    ok = [
        RequestResult(ok=True, ttft=0.1, itls=[0.01, 0.03], prompt_tokens=100, cached_tokens=0, output_tokens=3),
        RequestResult(ok=True, ttft=0.3, itls=[0.02], prompt_tokens=200, cached_tokens=150, output_tokens=2),
    ]
    failed = RequestResult(ok=False, error="HTTP 503: busy", prompt_tokens=999, cached_tokens=999, output_tokens=9)
    s = WorkloadResult("multi-turn", [*ok, failed], seconds=2.0).summary()
    assert s["requests"] == 3 and s["failed"] == 1 and s["errors"] == ["HTTP 503: busy"]
    assert s["ttft_p50_ms"] == pytest.approx(200.0)
    assert s["itl_p50_ms"] == pytest.approx(20.0)
    assert (s["prompt_tokens"], s["cached_tokens"], s["output_tokens"]) == (300, 150, 5)
    assert s["cached_share"] == 0.5
    assert s["output_tok_s"] == 2.5


def _summary(ttft_c1: float, cached_share: float, tok_s: float) -> dict:
    return {"random-c1": {"ttft_p50_ms": ttft_c1}, "multi-turn": {"cached_share": cached_share, "output_tok_s": tok_s}}


def test_targets_met_and_missed():
    results = {"vllm": _summary(100.0, 0.80, 50.0), "mesh-vllm": _summary(110.0, 0.72, 40.0)}
    met = {t["target"]: (t["measured"], t["met"]) for t in evaluate_targets(results)}
    assert list(met.values()) == [(1.1, True), (0.9, True), (0.8, True)]  # exactly at each threshold
    results["mesh-vllm"] = _summary(111.0, 0.70, 39.0)
    assert [t["met"] for t in evaluate_targets(results)] == [False, False, False]


def test_targets_not_measured_without_a_baseline():
    results = {"mesh-vllm": _summary(110.0, 0.7, 40.0), "vllm": {"random-c1": {"ttft_p50_ms": None}, "multi-turn": {}}}
    assert [t["met"] for t in evaluate_targets(results)] == [None, None, None]
    assert [t["met"] for t in evaluate_targets({})] == [None, None, None]


def test_random_prompts_are_reproducible_and_distinct():
    a, b = random_prompts(4, 128, 49152, seed=1), random_prompts(4, 128, 49152, seed=1)
    assert a == b and len({tuple(p) for p in a}) == 4
    assert all(len(p) == 128 and all(100 <= t < 49052 for t in p) for p in a)


def test_replace_section_appends_then_replaces():
    doc = "# Benchmarks\n\nintro\n"
    once = replace_section(doc, "## Serving\nfirst\n")
    assert once == "# Benchmarks\n\nintro\n\n<!-- vllm-serving-bench:start -->\n## Serving\nfirst\n<!-- vllm-serving-bench:end -->\n"
    twice = replace_section(once + "\n## Later section\n", "## Serving\nsecond")
    assert "first" not in twice and twice.count("vllm-serving-bench:start") == 1
    assert twice.endswith("second\n<!-- vllm-serving-bench:end -->\n\n## Later section\n")
    other = replace_section(twice, "## bench serve", name="vllm-bench-serve")  # the other mode's section is its own
    assert "second" in other and "## bench serve" in other


def test_bench_serve_targets():
    results = {
        "vllm": {"random-c1": {"output_tok_s": 20.0}, "random-c8": {"output_tok_s": 100.0}},
        "mesh-prefill0": {"random-c1": {"output_tok_s": 20.0, "failed": 0}, "random-c8": {"output_tok_s": 120.0, "failed": 2}},
        "mesh-kvmesh": {"random-c1": {"output_tok_s": 15.0, "failed": 0}, "random-c8": {"output_tok_s": 80.0, "failed": 1}},
    }
    got = [(t["server"], t["measured"], t["met"]) for t in evaluate_bench_serve_targets(results, [1, 8, 32])]
    assert got == [
        ("mesh-prefill0", 1.0, True), ("mesh-prefill0", 1.2, False),  # faster, but 2 requests failed
        ("mesh-prefill0", None, None),
        ("mesh-kvmesh", 0.75, False), ("mesh-kvmesh", 0.8, True), ("mesh-kvmesh", None, None),
    ]  # fmt: skip


def test_merge_json_keeps_the_other_mode():
    first = merge_json(None, "workloads", {"a": 1})
    both = merge_json(json.dumps(first), "bench-serve", {"b": 2})
    assert both == {"workloads": {"a": 1}, "bench-serve": {"b": 2}}
    assert merge_json(json.dumps(both), "workloads", {"a": 3})["workloads"] == {"a": 3}
    assert merge_json('{"old": "format"}', "workloads", {"a": 1}) == {"workloads": {"a": 1}}
    assert merge_json("not json", "workloads", {"a": 1}) == {"workloads": {"a": 1}}


def test_markdown_section_names_the_smoke_run_and_the_targets():
    row = {"requests": 4, "failed": 0, "ttft_p50_ms": 100.0, "ttft_p99_ms": 150.0, "itl_p50_ms": 20.0, "output_tok_s": 50.0,
           "prompt_tokens": 568, "cached_tokens": 256, "cached_share": 0.4507}  # fmt: skip
    results = {"vllm": {"multi-turn": row, "random-c1": row}, "mesh-vllm": {"multi-turn": dict(row, output_tok_s=45.0), "random-c1": row}}
    phase = {"machine_before": {"load_average": [0.1, 0.2, 0.3], "cpu_busy_3s": 0.01}}
    payload = {
        "command": ".venv/bin/python benchmarks/vllm_serving_bench.py --quick", "date": "2026-12-01 17:00 UTC",
        "machine": {"cpu": "AMD EPYC", "cores": 2, "avx512": True, "avx512_bf16": True, "amx": False, "vllm": "0.32.0"},
        "config": {"mode": "workloads", "quick": True, "dtype": "float32", "users": 2, "rounds": 2, "turn_tokens": 8,
                   "input_len": 128, "output_len": 16, "requests_c1": 2, "requests": 2},
        "report": {"phases": {"vllm": phase, "mesh-vllm": phase}, "results": results,
                   "targets": evaluate_targets(results), "kvmesh_engine_against_vllm": evaluate_targets(results, mesh="mesh-kvmesh")},
    }  # fmt: skip
    text = markdown(payload)
    assert "SMOKE RUN" in text and "AVX-512: yes, AVX-512-BF16: yes, AMX: no" in text
    assert "| vllm | multi-turn | 4 | 0 | 100.0 | 150.0 | 20.0 | 50.0 | 256 / 568 (45.1 %) |" in text
    assert "| TTFT p50 at concurrency 1 <= 1.10x vLLM alone | 1.000× | met (smoke run: no verdict) |" in text
    assert "| multi-turn output tokens/s >= 0.8x vLLM alone | 0.900× | met (smoke run: no verdict) |" in text
    assert "[mesh-kvmesh, for comparison] | — | not measured |" in text


def test_cpu_by_process_and_its_table():
    import os

    from benchmarks.vllm_serving_bench import cpu_seconds_between, cpu_table, process_label, ticks_by_label

    tick = os.sysconf("SC_CLK_TCK")
    assert cpu_seconds_between({"router": tick}, {"router": 3 * tick, "etcd": tick}) == {"etcd": 1.0, "router": 2.0}
    assert process_label(os.getpid()) in {"python", "python3", "pytest"} or process_label(os.getpid()).startswith("python")
    assert set(ticks_by_label([os.getpid()])) == {process_label(os.getpid())}
    results = {"mesh-prefill0": {"random-c32": {"seconds": 50.4, "cpu_seconds": {"router": 2.31, "decode_worker": 74.12, "etcd": 0.01}}}}
    lines = cpu_table(results)
    assert lines[-1] == "| mesh-prefill0 | random-c32 | 50.4 | decode_worker 74.1, router 2.3 |"
    assert cpu_table({"vllm": {"random-c1": {"seconds": 1.0}}}) == []


def test_profile_summary_by_thread():
    from benchmarks.serving_profile import summarize

    raw = (
        "process 1:\"python\";thread (7): MainThread;run (asyncio/runners.py:44);send (decode_worker/main.py:80) 3\n"
        "process 1:\"python\";thread (7): MainThread;run (asyncio/runners.py:44) 1\n"
        "process 1:\"python\";thread (9): kvmesh-engine;step (engine/llm_engine.py:200) 5\n"
    )
    out = summarize(raw)
    assert out["thread (7): MainThread"]["samples"] == 4
    assert out["thread (7): MainThread"]["own"] == [("send (decode_worker/main.py)", 3), ("run (asyncio/runners.py)", 1)]
    assert out["thread (7): MainThread"]["inclusive"][0] == ("run (asyncio/runners.py)", 4)
    assert out["thread (9): kvmesh-engine"]["own"] == [("step (engine/llm_engine.py)", 5)]


def test_baseline_servers_need_a_baseline_tree_and_run_from_it(tmp_path):
    from benchmarks.vllm_serving_bench import parse_args, server_start

    with pytest.raises(SystemExit):
        parse_args(["--vllm-python", "/x", "--servers", "mesh-vllm@base"])
    with pytest.raises(SystemExit):
        parse_args(["--vllm-python", "/x", "--baseline-tree", str(tmp_path), "--servers", "vllm@base"])  # not a mesh
    args = parse_args(["--vllm-python", "/x", "--baseline-tree", str(tmp_path), "--servers", "vllm-1core,mesh-vllm@base,mesh-vllm"])
    assert args.servers == ["vllm-1core", "mesh-vllm@base", "mesh-vllm"]
    label, _ = server_start("mesh-vllm@base", args)
    assert label == f"kvmesh up --engine vllm, from {tmp_path}"
    assert server_start("mesh-vllm", args)[0] == "kvmesh up --engine vllm"


def test_a_mesh_server_with_more_flags_is_its_own_row():
    from benchmarks.vllm_serving_bench import parse_args, server_start

    name = "mesh-prefill0:--max-num-batched-tokens=2048+--max-num-seqs=128"
    args = parse_args(["--vllm-python", "/x", "--servers", f"mesh-prefill0,{name}"])
    assert server_start(name, args)[0] == "kvmesh up --prefill 0 --max-num-batched-tokens=2048 --max-num-seqs=128"
    with pytest.raises(SystemExit):  # flags are for kvmesh up's servers only
        parse_args(["--vllm-python", "/x", "--servers", "vllm:--block-size=16"])


def test_a_mesh_server_with_flags_runs_from_the_baseline_tree_too(tmp_path):
    from benchmarks.vllm_serving_bench import parse_args, server_start

    args = parse_args(["--vllm-python", "/x", "--baseline-tree", str(tmp_path), "--servers", "mesh-kvmesh,mesh-kvmesh:--lend-cores@base"])
    label, _ = server_start("mesh-kvmesh:--lend-cores+--prefill=0@base", args)
    assert label == f"kvmesh up --lend-cores --prefill=0, from {tmp_path}"  # the flags without the suffix
    assert server_start("mesh-kvmesh:--lend-cores", args)[0] == "kvmesh up --lend-cores"
    with pytest.raises(SystemExit):  # never silently this tree's code: refused with the arguments
        parse_args(["--vllm-python", "/x", "--servers", "mesh-kvmesh,mesh-kvmesh:--lend-cores@base"])
    args.baseline_tree = None  # and by the start itself (vllm_interleaved_bench parses its own)
    with pytest.raises(SystemExit, match="needs --baseline-tree"):
        server_start("mesh-kvmesh:--lend-cores@base", args)


def test_a_server_name_with_a_path_in_its_flags_makes_a_plain_file_name():
    from benchmarks.vllm_serving_bench import file_stem

    stem = file_stem("mesh-kvmesh:--no-prefix-caching+--routing-config=/work/x/load.json")
    assert "/" not in stem and ":" not in stem and stem.startswith("mesh-kvmesh_--no-prefix-caching+--routing-config=")
