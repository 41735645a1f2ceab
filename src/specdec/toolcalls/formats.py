"""The tool-call syntax a chat template teaches its model, found from the template's text (as llama.cpp's chat
parser picks a format per model family)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family writes a call: `open` + a JSON object {name_key: name, arguments_key: {...}} + `close`,
    several calls one after another with `separator` between them; or, where `array` is set, `open` + one JSON
    array of such objects that ends the reply (Mistral). An empty `open` means the family writes a call as the
    whole reply, JSON alone (Llama 3.x)."""

    name: str
    open: str
    close: str
    separator: str
    name_key: str = "name"
    arguments_key: str = "arguments"
    # JSON separators the family's template shows its model (Python's json.dumps style for Hermes)
    item_separator: str = ", "
    key_separator: str = ": "
    array: bool = False

    @property
    def tags(self) -> tuple[str, str]:
        """The opening and closing tags themselves (a vocabulary may hold each as one added token)."""
        return self.open.strip(), self.close.strip()

    @property
    def parallel(self) -> bool:
        """Whether one reply may hold several calls in this format."""
        return self.array or bool(self.separator)


# Hermes-style calls: Qwen2.5 / Qwen2.5-Coder / Qwen3, NousResearch Hermes 2 and 3, and templates built on them.
# The template's system prompt shows `<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n
# </tool_call>`, and renders earlier calls the same way.
HERMES = ToolCallFormat(name="hermes", open="<tool_call>\n", close="\n</tool_call>", separator="\n")

# Mistral (Nemo, Small, Large 2 and their templates): `[TOOL_CALLS]` then a JSON array of the calls; the
# template writes earlier calls the same way ([TOOL_CALLS] is a control token of their vocabularies).
MISTRAL = ToolCallFormat(name="mistral", open="[TOOL_CALLS]", close="", separator=", ", array=True)

# Llama 3.1 / 3.2 / 3.3 with custom tools: the reply is the call itself, `{"name": ..., "parameters": {...}}`
# (the template asks for exactly that and has an `ipython` role for the results); one call per reply.
LLAMA3_JSON = ToolCallFormat(name="llama3-json", open="", close="", separator="", arguments_key="parameters")

# (marker in the template's text, format): the first marker found decides (llama.cpp's chat parser reads the
# template the same way).
KNOWN_FORMATS: tuple[tuple[str, ToolCallFormat], ...] = (
    ("<tool_call>", HERMES),
    ("[TOOL_CALLS]", MISTRAL),
    ("<|start_header_id|>ipython<|end_header_id|>", LLAMA3_JSON),
)


def detect_format(template: str | None) -> ToolCallFormat | None:
    """The tool-call format of a chat template, or None when the template renders no tools or uses a syntax
    this server does not know (then a request with tools is refused: a call it cannot parse would be lost)."""
    if not template or "tools" not in template:
        return None
    for marker, fmt in KNOWN_FORMATS:
        if marker in template:
            return fmt
    return None


def known_format_names() -> str:
    return ", ".join(f"{fmt.name} ({marker})" for marker, fmt in KNOWN_FORMATS)
