"""What CPU this is, for benchmark results (and, later, defaults chosen by the machine)."""

from __future__ import annotations

import platform
from pathlib import Path


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
