"""The errors a user's input or files can cause: each is printed as one line (CLI exit 2, HTTP 4xx), never a traceback."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user-supplied option is invalid; the message says which and why."""


class UserError(Exception):
    """An error caused by the user's input on the command line; printed as one line, exit code 2."""


class ModelLoadError(RuntimeError):
    """A model could not be found, assembled or loaded; the message says what to do."""


class VocabMismatchError(ValueError):
    """Draft and target do not share a tokenizer vocabulary, so draft tokens mean nothing to the target."""


class ContextOverflowError(ValueError):
    """More tokens were asked for than the cache was allocated to hold."""


# What the command line reports as one line and exit code 2 (ValueError: a library's refusal of a value).
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, ModelLoadError, VocabMismatchError, ContextOverflowError, UserError, ValueError)


def one_line(exc: BaseException) -> str:
    """An error message on one line: libraries' messages (transformers', huggingface_hub's) span several."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
