"""How the bench's markdown tables write one value: "–" for none, yes/**NO** for a flag, else the number."""

from __future__ import annotations


def format_cell(value, spec=".2f", suffix="") -> str:
    """A table cell: "–" for no value, yes/**NO** for a flag, else the number formatted."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    return f"{value:{spec}}{suffix}"


__all__ = ["format_cell"]
