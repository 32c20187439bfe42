"""``--dtype auto``: bfloat16 only where the CPU (or the CUDA GPU) has native bf16."""

from __future__ import annotations

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


def test_default_dtype_off_cpu_is_float32() -> None:
    assert machine.default_dtype("npu")[0] == "float32"


@pytest.mark.parametrize(("capability", "dtype"), [((9, 0), "bfloat16"), ((8, 0), "bfloat16"), ((7, 5), "float32")])
def test_default_dtype_on_a_gpu_follows_its_bf16_arithmetic(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], dtype: str
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "a GPU")
    got, reason = machine.default_dtype("cuda")
    assert got == dtype and f"compute capability {capability[0]}.{capability[1]}" in reason


def test_default_dtype_on_cuda_without_a_gpu_is_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert machine.default_dtype("cuda") == ("float32", "device cuda: torch sees no GPU")


def test_worker_dtype_auto_is_resolved_before_any_engine_sees_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "cpu_flags", lambda: "avx2 avx512_bf16")
    assert worker_settings("decode", [*MESH, "--dtype", "auto"]).engine.dtype == "bfloat16"
    monkeypatch.setattr(machine, "cpu_flags", lambda: "avx2")
    assert worker_settings("decode", [*MESH, "--dtype", "auto"]).engine.dtype == "float32"
    assert worker_settings("decode", [*MESH, "--dtype", "bfloat16"]).engine.dtype == "bfloat16"
