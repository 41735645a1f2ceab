"""Per-request caps checked before any model work: stop sequences, messages and content parts (count, length),
and prompt text for the context, before and after the chat template."""

from __future__ import annotations

from specdec.server.errors import APIError

# OpenAI allows 4 stop sequences; 16 leaves room for clients that send more (evaluation harnesses), and the
# engine checks every one of them after every step, so their number and length bound each step's cost.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256

# The chat template runs in Python once per message, and adds its role markers to each: 240k one-character
# messages expanded to 1.44M tokens and held the tokenizer thread 9.5 s before any context check. 2048 messages
# is more turns than a 4k-128k context holds with any template; a message's content parts are capped alike.
MAX_CHAT_MESSAGES = 2048
MAX_CONTENT_PARTS = 256

# Tokenizing takes time in proportion to the text, on the one helper thread every request's prompt goes
# through, so text that cannot fit the context is refused by its length, untokenized. The longest tokens of
# Qwen2.5's vocabulary (the default pair) decode to 128 characters (runs of spaces), and a byte-level BPE
# token never covers more characters than it has bytes, so with that vocabulary no text of more than 128
# characters per context token fits. (A tokenizer with longer tokens, or one that drops whitespace,
# normalizes text shorter or maps any unknown word to one token, could fit more: such text is refused all the
# same, the price of never tokenizing text of unbounded size.)
MAX_PROMPT_CHARS_PER_TOKEN = 128


def prompt_char_limit(max_context: int) -> int:
    """The most characters of prompt text (completion prompt, or all chat contents together) the server tokenizes."""
    return MAX_PROMPT_CHARS_PER_TOKEN * max_context


def check_prompt_chars(chars: int, max_context: int, param: str) -> None:
    """Refuse (400, context_length_exceeded) text too long to fit a `max_context`-token context, before tokenizing."""
    limit = prompt_char_limit(max_context)
    if chars > limit:
        raise APIError(
            400,
            f"the prompt text is {chars} characters long, more than the {limit} this server accepts for the model "
            f"context of {max_context} tokens ({MAX_PROMPT_CHARS_PER_TOKEN} per token); it was refused without "
            f"being tokenized: shorten the prompt",
            param=param, code="context_length_exceeded")


def check_rendered_chars(chars: int, max_context: int) -> None:
    """Refuse a chat whose text after the template (role markers and all) cannot fit, before tokenizing it."""
    limit = prompt_char_limit(max_context)
    if chars > limit:
        raise APIError(
            400,
            f"the messages are {chars} characters long with the chat template applied, more than the {limit} this "
            f"server accepts for the model context of {max_context} tokens; they were refused without being "
            f"tokenized: send fewer or shorter messages",
            param="messages", code="context_length_exceeded")
