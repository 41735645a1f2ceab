"""Structured outputs: JSON schemas compiled by llguidance (cached, bounded) into a LogitsProcessor per request.

Nothing is imported here: llguidance's glue imports transformers (seconds), so `grammar.compiler` is loaded on the
first schema, and `grammar.errors` (GrammarError) stays cheap for the server to import."""
