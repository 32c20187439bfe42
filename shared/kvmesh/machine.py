"""What CPU this is, for benchmark results and for the defaults chosen by the machine (dtype,
threads)."""

from __future__ import annotations

import os
import platform
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


def default_dtype(device_type: str = "cpu") -> tuple[str, str]:
    """The dtype ``--dtype auto`` picks here, and why: bfloat16 only where the CPU computes it
    natively (AMX-BF16 or AVX512-BF16), float32 elsewhere (emulated bf16 is many times slower);
    on a CUDA GPU bfloat16 where it has bf16 arithmetic (compute capability 8.0 and later)."""
    if device_type == "cuda":
        return _cuda_dtype()
    if device_type != "cpu":
        return "float32", f"device {device_type}: float32 unless --dtype says otherwise"
    flags = set(cpu_flags().split())
    for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")):
        if flag in flags:
            return "bfloat16", f"the CPU has {name} (native bf16)"
    return "float32", "the CPU has no native bf16 (no AVX512-BF16 or AMX-BF16)"


def _cuda_dtype() -> tuple[str, str]:
    import torch

    if not torch.cuda.is_available():
        return "float32", "device cuda: torch sees no GPU"
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if major >= 8:
        return "bfloat16", f"the GPU ({name}, compute capability {major}.{minor}) computes bf16 natively"
    return "float32", f"the GPU ({name}, compute capability {major}.{minor}) has no bf16 arithmetic"


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_worker(workers: int) -> int:
    """Each of ``workers`` engines' share of the usable cores (at least one thread)."""
    return max(1, usable_cores() // max(1, workers))
