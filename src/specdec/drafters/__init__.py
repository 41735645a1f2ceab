"""Drafters behind one protocol; importing this package registers the built-in ones."""

# Each drafter module registers its name on import ("draft_model", "hybrid", "prompt_lookup", "suffix").
from specdec.drafters import draft_model, hybrid, prompt_lookup, suffix  # noqa: F401
from specdec.drafters.base import Draft, Drafter, available_drafters, create_drafter, register_drafter

__all__ = ["Draft", "Drafter", "available_drafters", "create_drafter", "register_drafter"]
