"""The grammar (llguidance's Lark dialect) of one or more well-formed calls in a format, each naming an offered
tool with arguments that match that tool's parameter schema: what tool_choice "required" or a named function
constrains the output to."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from specdec.toolcalls.formats import ToolCallFormat


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's escapes (names are ASCII: see server/tools.py)


def arguments_schema(parameters: dict[str, Any] | None, fmt: ToolCallFormat) -> dict[str, Any]:
    """A tool's parameter schema for the grammar: an object when none is given (OpenAI's default), written
    with the separators the model's template shows it and no free whitespace."""
    schema = dict(parameters) if parameters else {"type": "object"}
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": fmt.item_separator,
                            "key_separator": fmt.key_separator}
    return schema


def _tagged(text: str, tag_tokens: Mapping[str, int]) -> str:
    """`text` as Lark items: a tag the vocabulary holds as one added token is that token (`<[id]>`: llguidance
    matches added tokens by id, never by their spelling), the rest literal strings."""
    for tag, token in tag_tokens.items():
        at = text.find(tag)
        if at >= 0:
            parts = [_tagged(text[:at], tag_tokens), f"<[{token}]>", _tagged(text[at + len(tag):], tag_tokens)]
            return " ".join(p for p in parts if p)
    return _literal(text) if text else ""


def tool_call_grammar(fmt: ToolCallFormat, tools: Sequence[tuple[str, dict[str, Any] | None]], parallel: bool,
                      tag_tokens: Mapping[str, int] | None = None) -> str:
    """Lark text: one call (or, when parallel, one or more separated by the format's separator) of the tools.
    tag_tokens: the format's tags that are single added tokens of the vocabulary (Qwen2.5's <tool_call>)."""
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    tags = dict(tag_tokens or {})
    parallel = parallel and fmt.parallel
    choice = f"({' | '.join(f'fn_{i}' for i in range(len(tools)))})"
    opening = _tagged(fmt.open, tags)
    if fmt.array:  # open + [fn, fn, ...]: the array ends the reply
        lines = [f"start: {opening} \"[\" {choice}" + (f" ({_literal(fmt.separator)} {choice})*" if parallel else "")
                 + " \"]\""]
    else:
        lines = ["start: call (sep call)*" if parallel else "start: call"]
        if parallel:
            lines.append(f"sep: {_literal(fmt.separator)}")
        lines.append(f"call: {' '.join(p for p in (opening, choice, _tagged(fmt.close, tags)) if p)}")
    for i, (name, parameters) in enumerate(tools):
        head = ("{" + json.dumps(fmt.name_key) + fmt.key_separator + json.dumps(name) + fmt.item_separator
                + json.dumps(fmt.arguments_key) + fmt.key_separator)
        lines.append(f"fn_{i}: {_literal(head)} args_{i} \"}}\"")
        lines.append(f"args_{i}: %json {json.dumps(arguments_schema(parameters, fmt), ensure_ascii=True)}")
    return "\n".join(lines) + "\n"
