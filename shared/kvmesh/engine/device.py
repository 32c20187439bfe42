"""Torch device selection: cpu, cuda, or npu (Ascend, through torch_npu, imported on demand)."""

from __future__ import annotations

import importlib

import torch
from kvmesh.errors import ModelLoadError


class DeviceError(ModelLoadError):
    pass


def resolve_device(name: str) -> torch.device:
    kind = name.split(":")[0]
    if kind == "npu":
        try:
            importlib.import_module("torch_npu")
        except ImportError as exc:
            raise DeviceError("device 'npu' needs torch_npu (Ascend); it is not installed") from exc
    elif kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device 'cuda' asked for, but torch sees no CUDA device")
    elif kind not in ("cpu", "cuda"):
        raise DeviceError(f"unknown device {name!r}: use cpu, cuda or npu")
    return torch.device(name)
