"""What CPU this is, for benchmark results and for the defaults chosen by the machine (dtype,
threads)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

# What ``--dtype`` takes everywhere: the engines' dtypes, and ``auto`` (``default_dtype`` picks).
DTYPE_CHOICES = ("float32", "bfloat16", "float16", "auto")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_flags() -> str:
    """The CPU's vector and matrix extensions (AVX*, AMX*), space-separated."""
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            return " ".join(sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx"))))
    return ""


def cpu_has_amx() -> bool:
    """Does the CPU have AMX for bfloat16 (oneDNN's tiles, whether or not kvmesh's tile kernel was
    built)? Where it does, the compiled kernels measured against oneDNN step aside sooner."""
    return "amx_bf16" in cpu_flags().split()


def default_dtype(device_type: str = "cpu") -> tuple[str, str]:
    """The dtype ``--dtype auto`` picks here, and why: bfloat16 only where the CPU computes it
    natively (AMX-BF16 or AVX512-BF16), float32 elsewhere (emulated bf16 is many times slower);
    on a CUDA GPU bfloat16 where it has bf16 arithmetic (compute capability 8.0 and later)."""
    kind, _, index = device_type.partition(":")
    if kind == "cuda":
        return _cuda_dtype(int(index) if index.isdigit() else 0)
    if kind != "cpu":
        return "float32", f"device {device_type}: float32 unless --dtype says otherwise"
    flags = set(cpu_flags().split())
    for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")):
        if flag in flags:
            return "bfloat16", f"the CPU has {name} (native bf16)"
    return "float32", "the CPU has no native bf16 (no AVX512-BF16 or AMX-BF16)"


def _cuda_dtype(index: int = 0) -> tuple[str, str]:
    """Asked of nvidia-smi, not torch: a CUDA context made here would hold GPU memory in
    ``kvmesh up``'s launcher for the mesh's life, and one made in a worker before vLLM starts
    forces vLLM to spawn its engine process."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader", "-i", str(index)],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        name, capability = done.stdout.strip().rsplit(",", 1)
        major, minor = (int(part) for part in capability.strip().split("."))
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return "float32", f"device cuda: nvidia-smi did not say GPU {index}'s compute capability"
    where = f"the GPU ({name.strip()}, compute capability {major}.{minor})"
    if major >= 8:
        return "bfloat16", f"{where} computes bf16 natively"
    return "float32", f"{where} has no bf16 arithmetic"


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_worker(workers: int) -> int:
    """Each of ``workers`` engines' share of the usable cores (at least one thread)."""
    return max(1, usable_cores() // max(1, workers))
