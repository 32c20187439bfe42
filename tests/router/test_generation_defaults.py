"""The model's generation_config.json sampling defaults fill what a request omits (vLLM's
``--generation-config auto``): a tiny model directory with such a file, a scripted backend."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest

from kvmesh.protocol import SamplingSpec
from kvmesh.services.router.app import create_app
from kvmesh.services.router.generation_defaults import GenerationDefaults
from kvmesh.settings.router import router_parser
from tests.router.fakes import FakeBackend
from tests.router.test_app import MODEL

CONFIG = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "do_sample": True,  # not a sampling default to vLLM either
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.1,
    "max_new_tokens": 7,
    "min_p": 5,  # out of range: dropped with a warning
}
WANT = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 7}


@pytest.fixture
def model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(tiny_model_dir, out)
    (out / "generation_config.json").write_text(json.dumps(CONFIG))
    return out


def test_what_is_read(model_dir: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        defaults = GenerationDefaults.load("auto", model_dir)
    assert defaults.values == WANT
    assert defaults.source == str(model_dir / "generation_config.json")
    assert "min_p=5 is not a value requests may have" in caplog.text
    assert GenerationDefaults.load("vllm", model_dir).values == {}
    assert GenerationDefaults.load(str(model_dir), tiny_model_dir).values == WANT  # another directory's file
    assert GenerationDefaults.load("auto", tiny_model_dir).values == {}  # its file has token ids and do_sample only
    assert not GenerationDefaults.load("auto", model_dir / "nowhere")


def test_the_routers_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert router_parser().parse_args([]).generation_config == "auto"
    monkeypatch.setenv("KVMESH_GENERATION_CONFIG", "vllm")
    assert router_parser().parse_args([]).generation_config == "vllm"


async def test_defaults_fill_what_a_request_omits(fake: FakeBackend, model_dir: Path) -> None:
    app = create_app(fake, generation_defaults=GenerationDefaults.load("auto", model_dir))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        asked = {**chat, "temperature": 0, "top_k": None, "max_tokens": 3, "repetition_penalty": 1.0}
        assert (await client.post("/v1/chat/completions", json=asked)).status_code == 200
        # completions' max_tokens defaults to 16 (OpenAI's), so the model's length default is not used
        assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})).status_code == 200
        resp = await client.post("/v1/responses", json={"model": MODEL, "input": "Hi"})
        assert resp.status_code == 200
        assert (resp.json()["temperature"], resp.json()["top_p"], resp.json()["max_output_tokens"]) == (0.6, 0.9, 7)
        fake.max_model_len = 20  # 15 prompt tokens leave room for 5: the default length is capped
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
    defaulted, asked_for, completion, responses, capped = (call.sampling for call in fake.calls)
    assert defaulted == SamplingSpec(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, max_tokens=7)
    assert asked_for == SamplingSpec(temperature=0.0, top_p=0.9, top_k=20, repetition_penalty=1.0, max_tokens=3)
    assert completion == SamplingSpec(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, max_tokens=16)
    assert responses == defaulted
    assert capped.max_tokens == 5


async def test_without_defaults_nothing_changes(fake: FakeBackend) -> None:
    app = create_app(fake, generation_defaults=GenerationDefaults())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
    assert fake.calls[0].sampling == SamplingSpec(temperature=1.0, top_p=1.0, max_tokens=fake.max_model_len - 15)
