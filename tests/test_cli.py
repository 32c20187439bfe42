"""The ``kvmesh`` command, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def kvmesh(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_generate_json_on_a_model_dir(tiny_model_dir):
    done = kvmesh("generate", "--model", str(tiny_model_dir), "--prompt", "The river", "--max-tokens", "6", "--ignore-eos", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert len(result["token_ids"]) == 6 and isinstance(result["text"], str)
    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64))
    [want] = engine.generate([engine.tokenizer.encode("The river")], SamplingParams(max_tokens=6, ignore_eos=True))
    assert result == {"token_ids": want.new_token_ids, "text": want.text}


@pytest.mark.slow
def test_default_model_chat_answers_paris(default_model_dir):
    cache = default_model_dir.parent.parent  # resolve_model's cache root
    done = kvmesh(
        "generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "32", "--json",
        env={"KVMESH_CACHE_DIR": str(cache)},
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in json.loads(done.stdout)["text"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-tokens", "0"], "--max-tokens: must be a positive integer"),
        (["--temperature", "-1"], "--temperature: must be >= 0"),
        (["--top-p", "2"], "top_p must be in (0, 1]"),
        (["--model", "/nonexistent/model"], "unknown model"),
    ],
)
def test_bad_input_gets_a_clear_message(args, message):
    done = kvmesh("generate", "--prompt", "hi", *args)
    assert done.returncode != 0
    assert message in done.stderr
    assert "Traceback" not in done.stderr
