"""Grammar-constrained decoding: structured output (JSON schema, JSON object, regex, choice).

The grammar library is llguidance (``benchmarks/grammar_libs_bench.py`` measures it against
xgrammar on kvmesh's tokenizer: it compiles faster and computes a mask faster, and it reads
the tokenizer from its ``tokenizer.json`` exactly, special tokens and all). A request names its
grammar with a ``GuidedDecoding`` (in its ``SamplingParams``, and on the wire); each engine
builds one ``GrammarCompiler`` for its tokenizer, lazily, which makes each request's
``GrammarState``: an ``llguidance.LLMatcher`` and how many of the request's generated tokens it
has consumed.

The state is never sent anywhere: before each of a request's samples the matcher consumes the
tokens generated since its last one (``Request.generated_token_ids``: those of an earlier
attempt, which a resumed request has at its prompt's tail, the first token a prefill worker
sampled, then its own). So a decode worker that takes over from a prefill worker, or a retry on
another worker, rebuilds the matcher from the spec and continues where the grammar was.

The mask: a token is allowed when the grammar allows it next; an EOS token only when the
grammar can end there (and it is the only token allowed once the grammar is complete). The
grammar wins: ``min_tokens`` masks EOS only while the grammar may go on, so a grammar that can
only end ends the request short of ``min_tokens``. ``ignore_eos`` with a grammar is refused at
the router (the grammar's end is the request's).

This module loads neither torch nor llguidance until a grammar is used: the protocol imports it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvmesh.engine.schema_finite import has_finite_instance

if TYPE_CHECKING:
    import torch

    from kvmesh.engine.request import Request
    from kvmesh.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "GUIDED_KINDS",
    "GrammarCompiler",
    "GrammarError",
    "GrammarState",
    "GuidedDecoding",
    "apply_grammar_masks",
    "check_guided",
    "grammar_of",
]

GuidedKind = Literal["json_schema", "json_object", "regex", "choice"]
GUIDED_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice")
MAX_GRAMMAR_CHARS = 64 * 1024  # a schema, regex or choice list crosses to the workers in every message
# JSON as OpenAI's models write it: one space after ':' and ',', no other whitespace (a small
# model allowed free whitespace can fill its whole budget with newlines).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema, regex or choice list that cannot be compiled (invalid, or uses a feature the
    grammar library does not support)."""


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    """What a request's output must match. ``value``: the JSON schema (JSON text) for
    ``json_schema``, the regex for ``regex``, the choices (a JSON list of strings) for
    ``choice``; empty for ``json_object`` (any JSON object)."""

    kind: GuidedKind
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise GrammarError(f"unknown guided decoding kind {self.kind!r}")
        if len(self.value) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"a {self.kind} may have at most {MAX_GRAMMAR_CHARS} characters")

    @classmethod
    def json_schema(cls, schema: Any) -> GuidedDecoding:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":")))

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GuidedDecoding:
        return cls("choice", json.dumps(list(choices)))


def _llguidance() -> Any:
    import llguidance

    return llguidance


def _lark_string(text: str) -> str:
    """A Lark string literal of ``text`` (JSON's escapes are Lark's)."""
    return json.dumps(text)


def json_schema_of(spec: GuidedDecoding) -> dict[str, Any]:
    """The schema of a ``json_schema`` spec (``true`` is the empty one); ``GrammarError``
    when it is not JSON or not an object."""
    try:
        schema = json.loads(spec.value)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from exc
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError("the JSON schema must be an object")
    return schema


def grammar_of(spec: GuidedDecoding) -> str:
    """The llguidance grammar of ``spec``; raises ``GrammarError`` when it is malformed (not
    yet whether llguidance supports it: ``check_guided``)."""
    llg = _llguidance()
    if spec.kind == "json_object":
        return str(llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS))
    if spec.kind == "json_schema":
        schema = json_schema_of(spec)
        if not has_finite_instance(schema):
            raise GrammarError("the JSON schema has no finite instance: a $ref it requires leads back to itself")
        try:
            return str(llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from exc
    if spec.kind == "regex":
        return str(llg.LLMatcher.grammar_from_regex(spec.value))
    try:
        choices = json.loads(spec.value)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"the choices are not a JSON list: {exc}") from exc
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("the choices must be a non-empty list of non-empty strings")
    return "start: " + " | ".join(_lark_string(c) for c in choices)


CHECK_CACHE_SIZE = 256
_checked: OrderedDict[bytes, str | None] = OrderedDict()  # (kind, value) digest -> the error, None: compiles
_checked_lock = threading.Lock()


def check_guided(spec: GuidedDecoding) -> None:
    """Raise ``GrammarError`` with llguidance's reason when ``spec`` cannot be compiled: an
    invalid schema or regex, or a schema feature it does not support (refused, never dropped).
    The verdicts of the last CHECK_CACHE_SIZE specs are kept: a spec is compiled once, however
    many requests (or paths of one request) send it."""
    key = hashlib.sha256(f"{spec.kind}\0{spec.value}".encode("utf-8", "surrogatepass")).digest()
    with _checked_lock:
        if key in _checked:
            _checked.move_to_end(key)
            error = _checked[key]
            if error is not None:
                raise GrammarError(error)
            return
    try:
        grammar = grammar_of(spec)
        is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar)
        error = _first_line(messages[0] if messages else "the grammar does not compile") if is_error else None
    except GrammarError as exc:
        error = str(exc)
    with _checked_lock:
        _checked[key] = error
        while len(_checked) > CHECK_CACHE_SIZE:
            _checked.popitem(last=False)
    if error is not None:
        raise GrammarError(error)


def _first_line(message: str) -> str:
    """llguidance's message without the grammar dump it may append."""
    text = message.split("<state>", 1)[0].split("<grammar>", 1)[0].strip()
    return " ".join(text.split())[:500]


class GrammarCompiler:
    """One engine's grammar maker: llguidance's view of the tokenizer (built on first use,
    about 0.3 s for a 49k vocabulary) and the model's vocabulary width and EOS tokens."""

    CACHE_SIZE = 64  # compiled grammars kept: a spec sent again is copied, not compiled

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._lltok: Any = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[GuidedDecoding, Any] = OrderedDict()  # spec -> a matcher that consumed nothing

    @property
    def lltokenizer(self) -> Any:
        with self._lock:
            if self._lltok is None:
                llg = _llguidance()
                eos = self.eos_token_ids[0] if self.eos_token_ids else None
                # The tokenizer's own tokenizer.json: the same byte-level vocabulary, merges and special tokens.
                self._lltok = llg.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
            return self._lltok

    def warm(self) -> threading.Thread:
        """Build llguidance's tokenizer and compute one mask in a background thread (about 1 s
        on a 49k vocabulary, which the first guided request would otherwise spend on the
        engine's thread); a request that comes first waits for the tokenizer only.

        Not a daemon thread: the process waits for it at exit. A daemon thread still inside
        llguidance when the interpreter finalizes is ended by a forced unwind through
        llguidance's Rust frames, which crashes the process (SIGSEGV): a ``kvmesh generate``
        that finished within the warm-up's first second died at exit one time in three."""

        def work() -> None:
            try:
                self.state(GuidedDecoding("json_object")).allowed()
            except Exception:  # noqa: BLE001 - the first guided request reports it
                logger.warning("warming the grammar compiler failed", exc_info=True)

        thread = threading.Thread(target=work, name="grammar-warm")
        thread.start()
        return thread

    def state(self, spec: GuidedDecoding) -> GrammarState:
        """A fresh matcher for ``spec``; raises ``GrammarError`` when it does not compile."""
        with self._lock:
            pristine = self._compiled.get(spec)
            if pristine is not None:
                self._compiled.move_to_end(spec)
        if pristine is None:
            grammar = grammar_of(spec)
            pristine = _llguidance().LLMatcher(self.lltokenizer, grammar, log_level=0)
            if pristine.is_error():
                raise GrammarError(_first_line(pristine.get_error()))
            with self._lock:
                self._compiled[spec] = pristine
                while len(self._compiled) > self.CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return GrammarState(pristine.deep_copy(), self)


class GrammarState:
    """One request's matcher, and how many of its generated tokens it has consumed."""

    __slots__ = ("matcher", "compiler", "consumed")

    def __init__(self, matcher: Any, compiler: GrammarCompiler) -> None:
        self.matcher = matcher
        self.compiler = compiler
        self.consumed = 0

    def advance(self, generated: Sequence[int]) -> None:
        """Consume the tokens of ``generated`` (all the request's generated tokens) not yet
        consumed. A token the grammar does not allow raises: the request is failed."""
        eos = self.compiler.eos_token_ids
        for token in generated[self.consumed :]:
            self.consumed += 1
            if token in eos:
                continue  # the request ends there; llguidance's EOS may be another of them
            if not self.matcher.consume_token(int(token)):
                raise GrammarError(f"token {token} does not match the grammar: {_first_line(self.matcher.get_error())}")

    def allowed(self) -> torch.Tensor:
        """The tokens allowed next, as a bool tensor over the model's vocabulary."""
        import numpy as np
        import torch

        matcher = self.matcher
        vocab = self.compiler.vocab_size
        if matcher.is_error():
            raise GrammarError(f"the grammar is in an error state: {_first_line(matcher.get_error())}")
        if matcher.is_stopped():
            mask = torch.zeros(vocab, dtype=torch.bool)
        else:
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            mask = torch.from_numpy(bits[:vocab].astype(np.bool_))
        accepting = matcher.is_accepting() or matcher.is_stopped()
        for token in self.compiler.eos_token_ids:
            if token < vocab:
                mask[token] = accepting
        if not bool(mask.any()):
            raise GrammarError("the grammar allows no next token")
        return mask


def apply_grammar_masks(logits: torch.Tensor, requests: Sequence[Request]) -> tuple[torch.Tensor, dict[int, Exception]]:
    """``logits`` (N, vocab) with every token a row's grammar does not allow next at -inf (a
    new tensor when any row has a grammar); and the rows whose grammar failed, by row."""
    rows = [row for row, req in enumerate(requests) if req.grammar is not None]
    if not rows:
        return logits, {}
    import torch

    failed: dict[int, Exception] = {}
    masks: list[torch.Tensor] = []
    kept: list[int] = []
    for row in rows:
        req = requests[row]
        try:
            req.grammar.advance(req.generated_token_ids)
            masks.append(req.grammar.allowed())
            kept.append(row)
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            logger.warning("request %s: grammar failed: %s", req.request_id, exc)
            failed[row] = exc
    out = logits.clone()
    if kept:
        index = torch.tensor(kept, device=logits.device)
        allowed = torch.stack(masks).to(logits.device)
        width = min(allowed.shape[1], logits.shape[1])
        sub = out.index_select(0, index)
        sub[:, :width] = sub[:, :width].masked_fill(~allowed[:, :width], float("-inf"))
        sub[:, width:] = float("-inf")
        # The grammar wins over what masked its tokens before it (min_tokens masks EOS and the
        # stop token ids): a row left with no token at all takes one its grammar allows, so a
        # grammar that can only end ends the request, even short of min_tokens.
        dead = ~torch.isfinite(sub).any(dim=1)
        if bool(dead.any()):
            fallback = torch.zeros_like(sub[:, :width]).masked_fill(~allowed[:, :width], float("-inf"))
            sub[dead, :width] = fallback[dead]
        out.index_copy_(0, index, sub)
    return out, failed
