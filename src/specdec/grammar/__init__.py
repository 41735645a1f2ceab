"""Structured outputs: JSON schemas compiled by llguidance (cached, bounded) into a LogitsProcessor per request."""

from specdec.grammar.compiler import GrammarCompiler, json_object_schema
from specdec.grammar.errors import GrammarError
from specdec.grammar.processor import GrammarProcessor

__all__ = ["GrammarCompiler", "GrammarError", "GrammarProcessor", "json_object_schema"]
