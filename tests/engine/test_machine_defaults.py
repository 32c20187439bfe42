"""``--dtype auto``: bfloat16 only where the CPU has native bf16."""

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
    assert machine.default_dtype("cuda")[0] == "float32"


def test_worker_dtype_auto_is_resolved_before_any_engine_sees_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "cpu_flags", lambda: "avx2 avx512_bf16")
    assert worker_settings("decode", [*MESH, "--dtype", "auto"]).engine.dtype == "bfloat16"
    monkeypatch.setattr(machine, "cpu_flags", lambda: "avx2")
    assert worker_settings("decode", [*MESH, "--dtype", "auto"]).engine.dtype == "float32"
    assert worker_settings("decode", [*MESH, "--dtype", "bfloat16"]).engine.dtype == "bfloat16"
