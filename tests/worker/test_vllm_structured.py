"""kvmesh's structured output as vLLM's (``kvmesh.worker.vllm_outputs.structured_outputs_kwargs``,
for vLLM's guidance backend), without vLLM: the grammar llguidance builds from what vLLM is
given accepts what kvmesh's engine's grammar accepts, JSON written as kvmesh's engine writes it
(one space after ``:`` and ``,``, no other whitespace), and refuses what it refuses."""

from __future__ import annotations

import json

import llguidance
import pytest

from kvmesh.engine.structured import GrammarError, GuidedDecoding, grammar_of
from kvmesh.worker.vllm_outputs import structured_outputs_kwargs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}


def _vllm_grammar(kwargs: dict) -> str:
    """What vLLM's ``serialize_guidance_grammar`` makes of them (vLLM 0.32, whitespace on)."""
    if "json" in kwargs:
        return llguidance.LLMatcher.grammar_from_json_schema(kwargs["json"], defaults={"whitespace_flexible": True})
    if "regex" in kwargs:
        return llguidance.grammar_from("regex", kwargs["regex"])
    return llguidance.grammar_from("choice", json.dumps(kwargs["choice"]))


def _accepts(grammar: str, text: str) -> bool:
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


class _ByteTokenizer:
    """One token per byte (and an EOS), enough for llguidance to match text."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"</s>"]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (GuidedDecoding.json_schema(SCHEMA), ['{"a": 1, "b": "x"}'], ['{"a":1,"b":"x"}', '{ "a": 1, "b": "x"}', '{"a": 1}']),
        (GuidedDecoding("json_object"), ['{"k": [1, 2]}', "{}"], ["[1]", '{"k":1}']),
        (GuidedDecoding("regex", r"[0-9]{3}-[a-z]+"), ["123-abc"], ["12-abc", "123-"]),
        (GuidedDecoding.choice(["Paris", "London"]), ["Paris", "London"], ["Rome", "Pari"]),
    ],
)
def test_vllm_gets_the_grammar_kvmeshs_engine_uses(spec: GuidedDecoding, good: list[str], bad: list[str]) -> None:
    ours, theirs = grammar_of(spec), _vllm_grammar(structured_outputs_kwargs(spec))
    for text in good:
        assert _accepts(ours, text) and _accepts(theirs, text), text
    for text in bad:
        assert not _accepts(ours, text) and not _accepts(theirs, text), text


def test_a_schemas_own_json_options_win_and_bad_specs_are_refused() -> None:
    own = {**SCHEMA, "x-guidance": {"whitespace_flexible": True}}
    assert structured_outputs_kwargs(GuidedDecoding.json_schema(own))["json"]["x-guidance"]["whitespace_flexible"] is True
    assert structured_outputs_kwargs(GuidedDecoding("json_schema", "true")) == {
        "json": {"x-guidance": structured_outputs_kwargs(GuidedDecoding("json_object"))["json"]["x-guidance"]}
    }
    for spec in (GuidedDecoding("json_schema", "[1]"), GuidedDecoding("json_schema", "{"), GuidedDecoding("choice", "[]")):
        with pytest.raises(GrammarError):
            structured_outputs_kwargs(spec)
