"""xgrammar vs llguidance on kvmesh's tokenizer: grammar compile time and per-token mask cost.

Measures, for the default model's tokenizer (SmolLM2, 49,152 tokens, byte-level BPE): the
tokenizer-info build, the compile of a JSON schema / json_object / regex grammar, and the cost
per token of computing the next-token mask and advancing the matcher along a valid answer.

    .venv/bin/pip install xgrammar==0.2.9   # only for this comparison; kvmesh uses llguidance
    .venv/bin/python benchmarks/grammar_libs_bench.py [--out benchmarks/grammar_libs_bench.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from kvmesh.engine.loader.default_model import resolve_model
from kvmesh.engine.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "kind": {"enum": ["a", "b", "c"]},
    },
    "required": ["name", "age", "email", "tags", "address", "kind"],
    "additionalProperties": False,
}
ANSWER = json.dumps(
    {"name": "Ada Lovelace", "age": 36, "email": "ada@math.com", "tags": ["math", "poetry"],
     "address": {"city": "London", "zip": "12345"}, "kind": "b"}
)
REGEX = r"[A-Z][a-z]{2,8} \d{3}-\d{4}"
REGEX_ANSWER = "Alice 555-1234"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _timed(fn, repeat: int = 3) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def bench_xgrammar(tok: Tokenizer, tokens: list[int], regex_tokens: list[int]) -> dict:
    import xgrammar as xgr

    backend = tok.backend
    vocab_size = tok.vocab_size
    encoded = [backend.id_to_token(i) or "" for i in range(vocab_size)]
    t_info, info = _timed(
        lambda: xgr.TokenizerInfo.from_vocab_and_metadata(
            encoded,
            json.dumps({"vocab_type": 2, "vocab_size": vocab_size, "add_prefix_space": False, "stop_token_ids": list(tok.eos_token_ids)}),
        ),
        1,
    )
    results: dict = {"library": "xgrammar " + importlib.metadata.version("xgrammar"), "tokenizer_info_s": t_info}

    def compiler():
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    t_schema, compiled = _timed(lambda: compiler().compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    t_obj, compiled_obj = _timed(lambda: compiler().compile_builtin_json_grammar())
    t_re, compiled_re = _timed(lambda: compiler().compile_regex(REGEX))
    results.update(compile_schema_s=t_schema, compile_json_object_s=t_obj, compile_regex_s=t_re)

    def walk(grammar, toks) -> list[float]:
        matcher = xgr.GrammarMatcher(grammar)
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        logits = torch.zeros(1, vocab_size)
        per = []
        for t in toks:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            ok = matcher.accept_token(t)
            per.append(time.perf_counter() - start)
            assert ok, t
        return per

    per = walk(compiled, tokens)
    per_re = walk(compiled_re, regex_tokens)
    results.update(mask_schema_ms_median=1e3 * statistics.median(per), mask_schema_ms_max=1e3 * max(per),
                   mask_regex_ms_median=1e3 * statistics.median(per_re))
    return results


def bench_llguidance(tok: Tokenizer, tokens: list[int], regex_tokens: list[int]) -> dict:
    import llguidance as llg

    vocab_size = tok.vocab_size
    eos = tok.eos_token_ids[0]
    t_info, lltok = _timed(lambda: llg.LLTokenizer(tok.backend.to_str(), n_vocab=vocab_size, eos_token=eos), 1)
    results: dict = {"library": "llguidance " + importlib.metadata.version("llguidance"), "tokenizer_info_s": t_info}
    schema_grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    obj_grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}')
    re_grammar = llg.LLMatcher.grammar_from_regex(REGEX)

    def compile_(g):
        m = llg.LLMatcher(lltok, g, log_level=0)
        assert not m.is_error(), m.get_error()
        m.compute_bitmask()  # the first mask is when llguidance builds its lexer (lazily)
        return m

    t_schema, _ = _timed(lambda: compile_(schema_grammar))
    t_obj, _ = _timed(lambda: compile_(obj_grammar))
    t_re, _ = _timed(lambda: compile_(re_grammar))
    results.update(compile_schema_s=t_schema, compile_json_object_s=t_obj, compile_regex_s=t_re)

    def walk(g, toks) -> list[float]:
        m = llg.LLMatcher(lltok, g, log_level=0)
        words = (vocab_size + 31) // 32
        bitmask = torch.full((1, words), -1, dtype=torch.int32)
        logits = torch.zeros(1, vocab_size)
        bits = torch.arange(32, dtype=torch.int32)
        per = []
        for t in toks:
            start = time.perf_counter()
            m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
            allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).reshape(1, -1)[:, :vocab_size].bool()
            logits.masked_fill_(~allowed, float("-inf"))
            ok = m.consume_token(t)
            per.append(time.perf_counter() - start)
            assert ok, (t, m.get_error())
        return per

    per = walk(schema_grammar, tokens)
    per_re = walk(re_grammar, regex_tokens)
    results.update(mask_schema_ms_median=1e3 * statistics.median(per), mask_schema_ms_max=1e3 * max(per),
                   mask_regex_ms_median=1e3 * statistics.median(per_re))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(resolve_model(None))
    tokens = tok.encode(ANSWER)
    regex_tokens = tok.encode(REGEX_ANSWER)
    report = {
        "cpu": _cpu(),
        "vocab_size": tok.vocab_size,
        "answer_tokens": len(tokens),
        "torch_threads": 1,
        "xgrammar": bench_xgrammar(tok, tokens, regex_tokens),
        "llguidance": bench_llguidance(tok, tokens, regex_tokens),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
