"""GrammarError, what every refusal of a schema or a grammar step raises, and the one-line form of llguidance's messages."""

from __future__ import annotations


class GrammarError(ValueError):
    """A schema the grammar engine refuses (unsupported feature, too large, invalid): the message says why."""


def first_line(message: str) -> str:
    """llguidance's message on one line, without the parser state dump some messages carry."""
    text = message.split("<state>")[0]
    # A regex error spans lines (the pattern, a caret, the reason): keep their words, drop the layout.
    words = " ".join(line.strip() for line in text.splitlines() if line.strip() and set(line.strip()) != {"^"})
    return words[:300] or "refused"
