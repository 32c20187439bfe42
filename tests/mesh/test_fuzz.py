"""schemathesis against a real mesh: requests generated from the router's own /openapi.json, valid
ones (the model pinned to the one served, so tokens are really generated) and invalid ones, on
every endpoint (the Responses API too). No answer may be a 5xx, none may contradict the schema's
description of the answers (an OpenAI error body for each error, the answer object or its SSE
stream for a 200), and afterwards both workers still serve a normal greedy request."""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import requests

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.infra.local_mesh import LocalMesh

pytestmark = pytest.mark.slow

logger = logging.getLogger(__name__)

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8  # generation is real, and each request short
GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
LENGTHS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
LENGTH = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_tokens", "/v1/responses": "max_output_tokens"}
# examples per (operation, mode): about 150 in all
EXAMPLES = {"generation": {"positive": 40, "negative": 30}, "other": {"positive": 5, "negative": 3}}
# KVMESH_FUZZ_SCALE=10 runs ten times as many; KVMESH_FUZZ_SEED=<int> other examples than the
# fixed, reproducible ones CI runs
SCALE = float(os.environ.get("KVMESH_FUZZ_SCALE", "1"))
SEED = os.environ.get("KVMESH_FUZZ_SEED")


def pinned_schema(raw: dict[str, Any], *, vocab_size: int, valid_only: bool) -> dict[str, Any]:
    """The router's schema with ``model`` pinned to the served model; for valid requests also
    completion lengths capped and prompt token ids within the vocabulary."""
    schema = copy.deepcopy(raw)
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
        body = schema["components"]["schemas"][name]
        props = body["properties"]
        props["model"] = {"type": "string", "enum": [MODEL]}
        if not valid_only:
            continue
        for key in LENGTHS:
            if key in props:
                props[key] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_TOKENS}, {"type": "null"}]}
        if "prompt" in props:
            props["prompt"]["anyOf"][1]["items"]["maximum"] = vocab_size - 1
            for listed in props["prompt"]["anyOf"][2:]:  # a list of prompts: a few, each its own request
                listed["maxItems"] = 3
    if valid_only:
        for parameter in schema["paths"]["/v1/models/{model}"]["get"]["parameters"]:
            parameter["schema"] = {"type": "string", "enum": [MODEL]}
    return schema


def capped(case: Any) -> Any:
    """A case whose completion, if the router accepts it, is at most MAX_TOKENS long: an absent
    or null length (the rest of the context) and any length the context could hold are capped."""
    body = case.body
    if isinstance(body, dict) and case.path in GENERATION:
        for key in LENGTHS:
            value = body.get(key)
            too_long = type(value) is int and MAX_TOKENS < value <= 100_000
            if too_long or (key == LENGTH[case.path] and value is None):
                body[key] = MAX_TOKENS
    return case


@dataclass
class Tally:
    statuses: dict[str, dict[int, int]] = field(default_factory=dict)
    server_errors: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)  # answers the schema does not describe

    def record(self, case: Any, response: requests.Response) -> None:
        counts = self.statuses.setdefault(case.operation.label, {})
        counts[response.status_code] = counts.get(response.status_code, 0) + 1
        logger.debug("%s %d %s", case.operation.label, response.status_code, response.text[:200])
        if response.status_code >= 500:
            self.server_errors.append(
                f"{response.status_code} {response.text[:300]}\n    {case.as_curl_command()[:2000]}"
            )
        from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

        try:
            case.validate_response(response, checks=[response_schema_conformance, content_type_conformance])
        except (Exception, BaseExceptionGroup) as exc:  # schemathesis' failure (group), naming what did not conform
            self.violations.append(f"{response.status_code} {exc}"[:1500] + f"\n    {case.as_curl_command()[:2000]}")


def fuzz(raw: dict[str, Any], base_url: str, vocab_size: int, tally: Tally) -> None:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis.errors import Unsatisfiable

    for mode, valid_only in ((schemathesis.GenerationMode.POSITIVE, True), (schemathesis.GenerationMode.NEGATIVE, False)):
        schema = schemathesis.openapi.from_dict(pinned_schema(raw, vocab_size=vocab_size, valid_only=valid_only))
        for result in schema.get_all_operations():
            operation = result.ok()
            kind = "generation" if operation.path in GENERATION else "other"
            examples = max(1, round(EXAMPLES[kind][mode.value] * SCALE))

            @given(case=operation.as_strategy(generation_mode=mode).map(capped))
            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=SEED is None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def run(case: Any) -> None:
                tally.record(case, case.call(base_url=base_url, timeout=60))

            if SEED is not None:
                run = seed(int(SEED))(run)

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (an operation without parameters)
                assert not mode.is_positive, operation.label
            logger.info("%s %s: %s", mode.value, operation.label, tally.statuses.get(operation.label))


GREEDY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


def test_no_request_the_schema_allows_or_not_is_a_server_error(mesh: LocalMesh, default_model_dir) -> None:
    raw = httpx.get(f"{mesh.base_url}/openapi.json", timeout=10).json()
    tally = Tally()
    fuzz(raw, mesh.base_url, Tokenizer.from_dir(default_model_dir).vocab_size, tally)
    total = sum(sum(counts.values()) for counts in tally.statuses.values())
    generated = sum(tally.statuses.get(f"POST {path}", {}).get(200, 0) for path in GENERATION)
    logger.info("%d requests, %d generated: %s", total, generated, json.dumps(tally.statuses))
    assert not tally.server_errors, "\n".join(tally.server_errors)
    assert not tally.violations, "\n".join(tally.violations)
    assert generated >= 20  # generation was really exercised
    assert all(tally.statuses.get(f"POST {path}", {}).get(200, 0) >= 10 for path in GENERATION), tally.statuses

    health = httpx.get(f"{mesh.base_url}/health", timeout=10)
    assert (health.status_code, health.json().get("workers")) == (200, {"prefill": 1, "decode": 1}), health.text
    response = httpx.post(f"{mesh.base_url}/v1/completions", json=GREEDY, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].startswith(" Paris")
