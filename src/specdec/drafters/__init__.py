"""Drafters behind one protocol; importing this package registers the built-in ones."""

from specdec.drafters import draft_model  # noqa: F401  (registers "draft_model")
from specdec.drafters import hybrid, prompt_lookup  # noqa: F401  (register "hybrid" and "prompt_lookup")
from specdec.drafters import suffix  # noqa: F401  (registers "suffix")
from specdec.drafters.base import Draft, Drafter, available_drafters, create_drafter, register_drafter

__all__ = ["Draft", "Drafter", "available_drafters", "create_drafter", "register_drafter"]
