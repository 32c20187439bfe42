"""The independent reference: Hugging Face transformers, full recompute, greedy.

``DEVICE`` is where the engine tests that use it run the engine and the reference:
``cpu`` unless ``KVMESH_TEST_DEVICE`` names another (``cuda``: the same tests on a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.testing.device import device_under_test

DEVICE = device_under_test()


def skip_unless_device_present() -> None:
    """Skip the calling module where ``DEVICE`` names a device this machine lacks."""
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(f"KVMESH_TEST_DEVICE={DEVICE}: torch sees no CUDA device", allow_module_level=True)


def load_reference(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.to(device)
    model.eval()
    return model


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' forward with its own KV cache; no logits
    processors (generate's min_new_tokens would mask EOS), no early stop."""
    out = model(torch.tensor([prompt], device=model.device), use_cache=True)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]], device=model.device), cache=out.cache, use_cache=True)
    return tokens


@torch.inference_mode()
def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens], device=model.device)).logits[0].float()
