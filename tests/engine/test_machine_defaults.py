"""``--dtype auto``: bfloat16 only where the CPU (or the CUDA GPU) has native bf16."""

from __future__ import annotations

import subprocess

import pytest

from kvmesh import machine
from kvmesh.settings.worker import worker_settings

MESH = ["--nats-url", "nats://127.0.0.1:1", "--etcd", "127.0.0.1:1"]  # parsed only, never dialled


@pytest.mark.parametrize(
    ("flags", "dtype", "why"),
    [
        ("avx avx2 avx512f avx512_bf16", "bfloat16", "AVX512-BF16"),
        ("avx2 amx_bf16 amx_tile avx512f", "bfloat16", "AMX-BF16"),
        ("avx avx2", "float32", "no native bf16"),
        ("", "float32", "no native bf16"),
    ],
)
def test_default_dtype_follows_the_cpu_flags(monkeypatch: pytest.MonkeyPatch, flags: str, dtype: str, why: str) -> None:
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    got, reason = machine.default_dtype("cpu")
    assert got == dtype and why in reason


@pytest.mark.parametrize(("flags", "amx"), [("avx2 amx_bf16 amx_tile avx512f", True), ("avx512f avx512_bf16", False), ("", False)])
def test_amx_is_the_cpu_flag(monkeypatch: pytest.MonkeyPatch, flags: str, amx: bool) -> None:
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    assert machine.cpu_has_amx() is amx


def test_default_dtype_off_cpu_is_float32() -> None:
    assert machine.default_dtype("npu")[0] == "float32"


@pytest.mark.parametrize(
    ("answer", "dtype", "why"),
    [
        ("NVIDIA H200, 9.0\n", "bfloat16", "the GPU (NVIDIA H200, compute capability 9.0) computes bf16 natively"),
        ("NVIDIA A100-SXM4-80GB, 8.0\n", "bfloat16", "compute capability 8.0) computes bf16 natively"),
        ("Tesla T4, 7.5\n", "float32", "the GPU (Tesla T4, compute capability 7.5) has no bf16 arithmetic"),
        ("", "float32", "nvidia-smi did not say GPU 1's compute capability"),
        ("Field \"compute_cap\" is not a valid field to query.\n", "float32", "did not say"),
    ],
)
def test_default_dtype_on_a_gpu_follows_its_bf16_arithmetic(
    monkeypatch: pytest.MonkeyPatch, answer: str, dtype: str, why: str
) -> None:
    """Asked of nvidia-smi for the GPU the device names, without torch making a CUDA context."""
    asked = []

    def run(argv, **_):
        asked.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout=answer, stderr="")

    monkeypatch.setattr(machine.subprocess, "run", run)
    got, reason = machine.default_dtype("cuda:1")
    assert got == dtype and why in reason
    assert asked == [["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader", "-i", "1"]]


def test_default_dtype_on_cuda_without_nvidia_smi_is_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(argv, **_):
        raise FileNotFoundError(argv[0])

    monkeypatch.setattr(machine.subprocess, "run", missing)
    assert machine.default_dtype("cuda") == ("float32", "device cuda: nvidia-smi did not say GPU 0's compute capability")


def test_worker_dtype_auto_is_resolved_before_any_engine_sees_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "cpu_flags", lambda: "avx2 avx512_bf16")
    assert worker_settings("decode", [*MESH, "--dtype", "auto"]).engine.dtype == "bfloat16"
    monkeypatch.setattr(machine, "cpu_flags", lambda: "avx2")
    assert worker_settings("decode", [*MESH, "--dtype", "auto"]).engine.dtype == "float32"
    assert worker_settings("decode", [*MESH, "--dtype", "bfloat16"]).engine.dtype == "bfloat16"
