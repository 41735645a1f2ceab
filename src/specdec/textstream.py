"""Incremental detokenization with stop-string detection (ending the tokens at the one that completes the stop) and hold-back of partial stop matches."""

from __future__ import annotations

from typing import Callable, Sequence


class TextStream:
    """Turns a growing token list into safe text deltas, ending at the first stop string.

    After a stop, `tokens` ends at the token in which the stop string was completed (later tokens
    of the same push are dropped) and `text` ends where the stop string begins.

    Text that might still become a stop string (a suffix that is a prefix of one), or that ends
    in an incomplete UTF-8 sequence, is held back until it is resolved.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self.decode = decode
        self.stop = tuple(stop)
        self.tokens: list[int] = []
        self.emitted = 0  # characters of the final text already handed out
        self.text = ""
        self.stopped = False

    def push(self, tokens: Sequence[int]) -> str:
        """Add tokens; return the new text that is safe to show."""
        if self.stopped:
            return ""
        before = len(self.tokens)
        self.tokens.extend(tokens)
        text = self.decode(self.tokens)
        search_from = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        cut = _first_stop(text, self.stop, search_from)
        if cut is not None:
            # Decoding one token at a time stops at the first token that completes a stop string (vLLM's
            # convention: tokens up to and including it); a batch of tokens (an accepted draft) must end at
            # that same token and cut the text the same way, so speculative and plain runs agree on both.
            for end in range(before + 1, len(self.tokens)):
                prefix = self.decode(self.tokens[:end])
                found = _first_stop(prefix, self.stop, search_from)
                if found is not None:
                    text, cut = prefix, found
                    del self.tokens[end:]
                    break
            self.stopped = True
            self.text = text[:cut]
            return self._take(len(self.text))
        self.text = text
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))
        safe = min(safe, len(text) - _partial_stop_suffix(text, self.stop))
        return self._take(safe)

    def flush(self) -> str:
        """At the end of generation everything not cut by a stop string is released."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta


def _first_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    positions = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(positions) if positions else None


def _partial_stop_suffix(text: str, stops: Sequence[str]) -> int:
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
