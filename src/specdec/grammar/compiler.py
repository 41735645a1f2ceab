"""JSON schema -> a checked llguidance grammar, over the target's tokenizer: bounded in size and work, cached by the
schema's hash, every refusal a GrammarError that names the problem."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf

from specdec.grammar.errors import GrammarError, first_line
from specdec.grammar.processor import GrammarProcessor

MAX_SCHEMA_BYTES = 64 * 1024  # a schema's JSON text; BFCL's largest function schema is ~3 KiB
# A Lark grammar's text: a tool-call grammar holds every offered tool's parameter schema (server/tools.py caps
# the tools at 256 KiB of JSON together)
MAX_LARK_BYTES = 512 * 1024
CACHED_GRAMMARS = 128
# llguidance's own bounds on the work of building a grammar (its defaults are 1M lexer fuel, 500k symbols:
# ~20 ms and ~1 s of a core); these hold a request's compile to tens of milliseconds on the 2-vCPU EPYC.
INITIAL_LEXER_FUEL = 300_000
MAX_GRAMMAR_SIZE = 100_000


def json_object_schema() -> dict[str, Any]:
    """response_format {"type": "json_object"}: any JSON object (OpenAI's JSON mode)."""
    return {"type": "object"}


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar llguidance accepted, ready for a matcher per request."""

    key: str  # sha256 of the grammar's source (the schema's compact text, or the Lark text)
    grammar: str  # llguidance's serialized grammar


class GrammarCompiler:
    """Compiles schemas for one tokenizer. Building llguidance's tokenizer costs about a second on a 150k vocabulary,
    so it is built once, on first use; compiled grammars are kept by schema hash (least recently used out)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self._tokenizer = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        """llguidance's view of the target's vocabulary (every logit column; EOS ids = the target's)."""
        if self._tokenizer is None:
            if self.hf_tokenizer is None:
                raise GrammarError("structured output needs the model's tokenizer; this model has none")
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_ids or None)
            except (ValueError, TypeError, AttributeError) as exc:
                raise GrammarError(f"structured output cannot use this model's tokenizer: {exc}") from None
        return self._tokenizer

    def limits(self):
        return llguidance.LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL, max_grammar_size=MAX_GRAMMAR_SIZE,
                                         verbose_errors=False)

    def compile_for(self, params) -> CompiledGrammar:
        """The grammar of a request's SamplingParams (json_schema or lark_grammar)."""
        if params.lark_grammar is not None:
            return self.compile_lark(params.lark_grammar)
        return self.compile_json_schema(json.loads(params.json_schema))

    def compile_json_schema(self, schema: Any) -> CompiledGrammar:
        """A schema (a JSON object) as a grammar; GrammarError when it is not an object, too large, or refused."""
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if len(text.encode()) > MAX_SCHEMA_BYTES:
            raise GrammarError(f"the JSON schema is {len(text.encode())} bytes; at most {MAX_SCHEMA_BYTES}")

        def build() -> str:
            try:
                # Compact separators and no free whitespace: more of the output is forced (free drafts), and a
                # model cannot pad the text with whitespace until max_tokens.
                return llguidance.LLMatcher.grammar_from_json_schema(
                    text, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
            except ValueError as exc:
                raise GrammarError(f"the JSON schema could not be read: {exc}") from None

        return self._compiled("json:" + text, build, "the JSON schema is not supported")

    def compile_lark(self, text: str) -> CompiledGrammar:
        """A Lark grammar (llguidance's dialect, %json rules included) as a grammar; bounded like a schema."""
        if len(text.encode()) > MAX_LARK_BYTES:
            raise GrammarError(f"the grammar is {len(text.encode())} bytes; at most {MAX_LARK_BYTES}")

        def build() -> str:
            try:
                return llguidance.LLMatcher.grammar_from_lark(text)
            except ValueError as exc:
                raise GrammarError(f"the grammar could not be read: {exc}") from None

        return self._compiled("lark:" + text, build, "the grammar is not supported")

    def _compiled(self, source: str, build, refusal: str) -> CompiledGrammar:
        key = hashlib.sha256(source.encode()).hexdigest()  # of the text as given: property order is the output order
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = build()
        message = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=self.limits())
        if message and not message.startswith("WARNING"):
            raise GrammarError(f"{refusal}: {first_line(message)}")
        compiled = CompiledGrammar(key, grammar)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def processor(self, compiled: CompiledGrammar):
        """A fresh matcher for one request (grammar/processor.py)."""
        return GrammarProcessor(self, compiled)


__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarError", "json_object_schema", "MAX_SCHEMA_BYTES"]
