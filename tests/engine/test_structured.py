"""Grammar-constrained decoding (``kvmesh.engine.structured``): llguidance's tokenizer is
kvmesh's exactly, the mask allows exactly the tokens the grammar allows (EOS only where it may
end), a matcher rebuilt over the tokens already generated continues where the grammar was, and
the engine's output always parses and validates, for 50 schemas, greedy and sampled."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading

import jsonschema
import pytest
import torch

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import FinishReason, Request, SamplingParams
from kvmesh.engine.sampler import sample_rows
from kvmesh.engine.structured import GrammarCompiler, GrammarError, GuidedDecoding, check_guided
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import ErrorCode
from kvmesh.protocol import SamplingSpec


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=2048, max_num_seqs=128))


@pytest.fixture(scope="module")
def compiler(engine: LLMEngine) -> GrammarCompiler:
    return GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)


def token_bytes(tokenizer: Tokenizer) -> dict[int, bytes]:
    """Each ordinary token's bytes, from the byte-level BPE alphabet (GPT-2's byte mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    decoder = {chr(c): b for b, c in zip(printable, chars)}
    out = {}
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token(i)
        if piece is not None and all(ch in decoder for ch in piece):
            out[i] = bytes(decoder[ch] for ch in piece)
    return out


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_llguidance_sees_kvmeshs_tokenizer_exactly(which: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue("tiny_model_dir" if which == "tiny" else "default_model_dir")
    tokenizer = Tokenizer.from_dir(model_dir)
    lltok = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids).lltokenizer
    special = {i for i, added in tokenizer.backend.get_added_tokens_decoder().items() if added.special}
    assert special and all(lltok.is_special_token(i) for i in special)
    pieces = token_bytes(tokenizer)
    # llguidance marks special tokens with a leading 0xFF byte, which is never in UTF-8 text, so
    # the lone-0xFF token reads as empty there: no grammar over text can use it either way.
    ordinary = [i for i in pieces if i not in special and pieces[i] != b"\xff"]
    assert len(ordinary) > 0.99 * (tokenizer.vocab_size - len(special))
    assert all(lltok.decode_bytes([i]) == pieces[i] for i in ordinary)
    assert not any(lltok.is_special_token(i) for i in ordinary)
    for text in ['{"name": "Ada", "age": 36}', "Hello, world! 12345\n\tüñí€ 🙂", "  spaced   out  "]:
        assert lltok.tokenize_str(text) == tokenizer.encode(text)


def first_allowed(compiler: GrammarCompiler, spec: GuidedDecoding, consumed: list[int] = ()) -> set[int]:  # type: ignore[assignment]
    state = compiler.state(spec)
    state.advance(list(consumed))
    return set(torch.nonzero(state.allowed()).flatten().tolist())


def test_the_mask_allows_exactly_the_prefixes_of_the_choices(engine: LLMEngine, compiler: GrammarCompiler) -> None:
    choices = ["yes", "no thanks"]
    pieces = token_bytes(engine.tokenizer)
    want = {i for i, b in pieces.items() if b and any(c.encode().startswith(b) for c in choices)}
    assert first_allowed(compiler, GuidedDecoding.choice(choices)) == want
    # after the whole of one choice only EOS is left
    done = engine.tokenizer.encode("yes")
    assert first_allowed(compiler, GuidedDecoding.choice(choices), done) == set(engine.eos_token_ids)
    # and EOS is never allowed before the grammar may end
    assert not first_allowed(compiler, GuidedDecoding.choice(choices)) & set(engine.eos_token_ids)


def test_eos_is_allowed_where_the_grammar_may_end_or_go_on(engine: LLMEngine, compiler: GrammarCompiler) -> None:
    spec = GuidedDecoding("regex", "[0-9]{1,3}")
    one = engine.tokenizer.encode("7")
    allowed = first_allowed(compiler, spec, one)
    assert set(engine.eos_token_ids) <= allowed and allowed - set(engine.eos_token_ids)


def test_a_rebuilt_matcher_continues_where_the_grammar_was(engine: LLMEngine, compiler: GrammarCompiler) -> None:
    spec = GuidedDecoding.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    text = '{"a": 12'
    tokens = engine.tokenizer.encode(text)
    stepped = compiler.state(spec)
    for i in range(len(tokens)):
        stepped.advance(tokens[: i + 1])  # one token at a time, as the sampler does
    rebuilt = compiler.state(spec)
    rebuilt.advance(tokens)  # all at once, as a decode worker or a retry does
    assert torch.equal(stepped.allowed(), rebuilt.allowed())
    bad = compiler.state(spec)
    with pytest.raises(GrammarError, match="does not match the grammar"):
        bad.advance(engine.tokenizer.encode("[1"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GuidedDecoding.json_schema({"type": "strin"}), "Invalid type"),
        (GuidedDecoding.json_schema({"not": {"type": "string"}}), "Unimplemented keys"),
        (GuidedDecoding.json_schema({"$ref": "#/nowhere"}), "does not exist"),
        (GuidedDecoding("json_schema", "{nope"), "not valid JSON"),
        (GuidedDecoding("regex", "(ab"), "unclosed group"),
        (GuidedDecoding("choice", "[]"), "non-empty list"),
        # compiled by llguidance, but no instance ends: nothing, or a parser error mid-answer
        (GuidedDecoding.json_schema({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}), "no finite instance"),
        (GuidedDecoding.json_schema({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}), "no finite instance"),
    ],
)
def test_what_cannot_be_compiled_is_refused_with_the_reason(spec: GuidedDecoding, message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        check_guided(spec)


def test_a_guided_row_leaves_the_other_rows_of_its_batch_alone(engine: LLMEngine, compiler: GrammarCompiler) -> None:
    logits = torch.randn(2, engine.model_config.vocab_size, generator=torch.Generator().manual_seed(0))
    plain = Request("plain", [5, 6, 7], SamplingParams(), engine.eos_token_ids)
    guided = Request("guided", [5, 6, 7], SamplingParams(guided=GuidedDecoding.choice(["yes"])), engine.eos_token_ids)
    guided.grammar = compiler.state(guided.sampling.guided)  # type: ignore[arg-type]
    chosen = sample_rows(logits, [plain, guided])
    assert chosen[0] == int(torch.argmax(logits[0]))
    assert chosen[1] in first_allowed(compiler, GuidedDecoding.choice(["yes"]))


def test_the_spec_crosses_the_wire() -> None:
    params = SamplingParams(max_tokens=8, guided=GuidedDecoding("regex", "a+"))
    spec = SamplingSpec.from_params(params)
    assert SamplingSpec.decode(spec.encode()).to_params() == params
    assert "guided" not in SamplingSpec.from_params(SamplingParams()).model_dump_json()


# --------------------------------------------------------------------------- 50 schemas
def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A schema whose every value is bounded, so a random-weight model always ends it."""
    kinds = ["string", "integer", "boolean", "enum", "null", "pattern", "const"]
    if depth < 2:
        kinds += ["object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True, "a b"], rng.randint(1, 4))}
    if kind == "null":
        return {"type": "null"}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{2,5}$", "^[0-9]{3}-[0-9]{4}$", "^(cat|dog)s?$"])}
    if kind == "const":
        return {"const": rng.choice(["fixed", 42, False])}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    names = rng.sample(["id", "name", "tags", "ok", "size", "kind", "meta", "note"], rng.randint(1, 4))
    required = [n for n in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": {n: random_schema(rng, depth + 1) for n in names},
        "required": required,
        "additionalProperties": False,
    }


SCHEMAS = [random_schema(random.Random(seed)) for seed in range(50)]


def run_all(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    return engine.generate(prompts, params)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fifty_schemas_always_parse_and_validate(engine: LLMEngine, temperature: float) -> None:
    prompt = engine.tokenizer.encode("Answer in JSON:")
    params = [
        SamplingParams(max_tokens=400, temperature=temperature, seed=i, guided=GuidedDecoding.json_schema(schema))
        for i, schema in enumerate(SCHEMAS)
    ]
    outs = run_all(engine, [prompt] * len(SCHEMAS), params)
    for schema, out in zip(SCHEMAS, outs):
        assert out.finish_reason is FinishReason.STOP, (schema, out.text, out.error)
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_regex_and_choice(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("Say something:")
    specs = [
        GuidedDecoding("json_object"),
        GuidedDecoding("regex", r"[A-Z][a-z]{1,6} [0-9]{3}-[0-9]{4}"),
        GuidedDecoding.choice(["positive", "negative", "neutral"]),
    ]
    for temperature in (0.0, 1.0):
        outs = run_all(engine, [prompt] * 3, [SamplingParams(max_tokens=200, temperature=temperature, seed=3, guided=s) for s in specs])
        assert all(out.finish_reason is FinishReason.STOP for out in outs), [(o.text, o.error) for o in outs]
        assert isinstance(json.loads(outs[0].text), dict)
        assert re.fullmatch(r"[A-Z][a-z]{1,6} [0-9]{3}-[0-9]{4}", outs[1].text)
        assert outs[2].text in ("positive", "negative", "neutral")


def test_a_resumed_request_continues_the_grammar_of_its_first_attempt(engine: LLMEngine) -> None:
    """What a retry after a fault sends: the prompt plus what was generated, with
    prior_output_tokens; greedy, the two attempts together give the uninterrupted answer."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    prompt = engine.tokenizer.encode("Answer in JSON:")
    guided = GuidedDecoding.json_schema(schema)
    [whole] = run_all(engine, [prompt], [SamplingParams(max_tokens=400, guided=guided)])
    assert len(whole.new_token_ids) > 4
    for cut in (1, 3):
        [first] = run_all(engine, [prompt], [SamplingParams(max_tokens=cut, guided=guided)])
        assert first.finish_reason is FinishReason.LENGTH
        resumed = SamplingParams(max_tokens=400 - cut, guided=guided, prior_output_tokens=cut)
        [rest] = run_all(engine, [prompt + first.new_token_ids], [resumed])
        assert first.new_token_ids + rest.new_token_ids == whole.new_token_ids
        jsonschema.validate(json.loads(first.text + rest.text), schema)


def test_a_schema_the_engine_cannot_compile_is_refused_at_add(engine: LLMEngine) -> None:
    with pytest.raises(GrammarError):
        engine.add_request("bad-grammar", [5, 6], SamplingParams(guided=GuidedDecoding("regex", "(")))
    assert not engine.has_unfinished()


def test_tokens_the_grammar_refuses_fail_the_request_as_its_own_fault(engine: LLMEngine) -> None:
    """A resumed request whose earlier tokens do not match its grammar: a 400-class error for
    that request alone (not the engine's), and the request next to it is served."""
    prompt = engine.tokenizer.encode("Answer in JSON:")
    bad_tail = engine.tokenizer.encode("hello")
    guided = GuidedDecoding("json_object")
    engine.add_request("bad-tail", prompt + bad_tail, SamplingParams(max_tokens=50, guided=guided, prior_output_tokens=len(bad_tail)))
    engine.add_request("good", prompt, SamplingParams(max_tokens=50, guided=guided))
    finals, texts = {}, {"good": ""}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            if out.finished:
                finals[out.request_id] = out
    bad = finals["bad-tail"]
    assert (bad.finish_reason, bad.error_code) == (FinishReason.ERROR, ErrorCode.BAD_REQUEST)
    assert "does not match the grammar" in (bad.error or "")
    assert finals["good"].finish_reason is FinishReason.STOP and isinstance(json.loads(texts["good"]), dict)


@pytest.mark.parametrize("extra", [{"min_tokens": 6}, {"min_tokens": 6, "stop_token_ids": (7,)}])
def test_a_complete_grammar_ends_the_request_before_min_tokens(engine: LLMEngine, extra: dict) -> None:
    """Once the grammar is complete only EOS is allowed; min_tokens masked it too, so every
    token was -inf and the request failed (bad_request). The grammar wins: the request ends."""
    prompt = engine.tokenizer.encode("Answer:")
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=1, guided=GuidedDecoding.choice(["yes"]), **extra)
        [out] = run_all(engine, [prompt], [params])
        assert (out.finish_reason, out.error, out.text) == (FinishReason.STOP, None, "yes")


def test_min_tokens_still_holds_while_the_grammar_may_go_on(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("Answer:")
    [out] = run_all(engine, [prompt], [SamplingParams(max_tokens=20, min_tokens=5, guided=GuidedDecoding("regex", "[a-z]{1,15}"))])
    assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and out.error is None
    assert len(out.new_token_ids) >= 5 and re.fullmatch("[a-z]{1,15}", out.text)


def test_the_grammar_tokenizer_is_warmed_off_the_engine_thread(tiny_model_dir) -> None:
    """llguidance's tokenizer and a first mask cost ~1 s on a real vocabulary: built in the
    background at engine start, not on the first guided request's step."""
    import threading
    import time

    fresh = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=64, max_num_seqs=4))
    assert any(t.name == "grammar-warm" for t in threading.enumerate()) or fresh._grammars._lltok is not None
    deadline = time.monotonic() + 30
    while fresh._grammars._lltok is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fresh._grammars._lltok is not None


def test_a_compiled_grammar_is_reused_by_copy(compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvmesh.engine.structured as structured

    compiled = []
    real = structured.grammar_of
    monkeypatch.setattr(structured, "grammar_of", lambda spec: compiled.append(spec) or real(spec))
    spec = GuidedDecoding.choice(["alpha", "beta"])
    first, second = compiler.state(spec), compiler.state(spec)
    assert compiled == [spec] and first.matcher is not second.matcher
    before = first.allowed()
    [token] = [t for t in range(compiler.vocab_size) if before[t] and t not in compiler.eos_token_ids][:1]
    first.advance([token])
    assert torch.equal(second.allowed(), before)  # the copy's state is its own


EXIT_WHILE_WARMING = """
import sys, time
from kvmesh.engine.structured import GrammarCompiler
from kvmesh.engine.tokenizer import Tokenizer

GrammarCompiler(Tokenizer.from_dir(sys.argv[1]), int(sys.argv[2]), [0]).warm()
time.sleep(float(sys.argv[3]))
"""


def test_a_process_ending_while_the_grammar_warms_exits_cleanly(default_model_dir):
    """The warm-up builds llguidance's tokenizer for the default model's 49k vocabulary (about
    0.25 s, outside the GIL); a process that ends meanwhile (a ``kvmesh generate`` that was
    quick) exits with 0, not with a crash at finalization, whenever in the warm-up it ends."""
    vocab_size = json.loads((default_model_dir / "config.json").read_text())["vocab_size"]
    for delay in ("0", "0.05", "0.1", "0.2"):
        args = [sys.executable, "-c", EXIT_WHILE_WARMING, str(default_model_dir), str(vocab_size), delay]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (delay, done.returncode, done.stderr[-2000:])


def test_an_engine_without_the_warm_up_compiles_on_the_first_guided_request(tiny_model_dir):
    """``warm_grammar=False`` (``kvmesh generate``): no warm-up thread starts, and a guided
    request still gets a grammar (llguidance's tokenizer built on its first step)."""
    before = {t for t in threading.enumerate() if t.name == "grammar-warm"}
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=256, warm_grammar=False))
    assert not {t for t in threading.enumerate() if t.name == "grammar-warm"} - before  # none new
    prompt = engine.tokenizer.encode("Answer:")
    [out] = run_all(engine, [prompt], [SamplingParams(max_tokens=60, guided=GuidedDecoding("regex", "[a-z]{3,5}"))])
    assert out.error is None and re.fullmatch("[a-z]{3,5}", out.text), out.text
