"""Incremental detokenization with stop-string detection (ending the tokens at the one that completes the stop) and hold-back of partial stop matches."""

from __future__ import annotations

from typing import Callable, Sequence

# Tokens already decoded for good that are decoded again in front of the new ones (at least this many where
# the stream has them): a decoder may write a token differently at the start of its input than after others
# (SentencePiece drops the leading space of the first word, a word-level decoder joins words with spaces).
_CONTEXT_TOKENS = 4


class TextStream:
    """Turns a growing token list into safe text deltas, ending at the first stop string.

    After a stop, `tokens` ends at the token in which the stop string was completed (later tokens
    of the same push are dropped) and `text` ends where the stop string begins.

    Text that might still become a stop string (a suffix that is a prefix of one), or that ends
    in an incomplete UTF-8 sequence, is held back until it is resolved.

    The text is what `decode(tokens)` gives for all the tokens, but a push decodes only the new tokens and a
    few before them (vLLM's prefix and read offsets): `tokens[:read]` have been decoded for good, their text
    ending on a whole character; the new tokens' text is `decode(tokens[prefix:])` less
    `decode(tokens[prefix:read])`, where `prefix` is an earlier such boundary a few tokens back. Text that
    ends in U+FFFD (an incomplete character) is decoded again with the next tokens until it completes. The
    stop-string search covers only text that was not handed out yet and the longest stop string before it.
    (A decoder that rewrites whole characters when more tokens follow, as HF's ByteFallback does to a run
    of byte tokens while its last character is incomplete, differs: the stream keeps the whole characters.)
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self.decode = decode
        self.stop = tuple(stop)
        self.tokens: list[int] = []
        self.emitted = 0  # characters of the final text already handed out
        self.stopped = False
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        # Token offsets: tokens[:_read] are decoded for good; tokens[_prefix:_read] are decoded again in front
        # of the new ones, and _prefix_text is their text in that window. _marks: offsets where decoded text
        # ended on a whole character, from _prefix on, the candidates for the next _prefix.
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""
        self._marks = [0]
        # text == "".join(_frozen) + _head + _tail, and _base == len("".join(_frozen)). The frozen text lies
        # before anything a later push searches for a stop string or hands out; _head is the rest of
        # tokens[:_read]'s text, _tail the text of tokens[_read:] (it may end in U+FFFD).
        self._frozen: list[str] = []
        self._base = 0
        self._head = ""
        self._tail = ""

    @property
    def text(self) -> str:
        """The text so far: everything decoded, or after a stop everything before the stop string."""
        if len(self._frozen) > 1:
            self._frozen[:] = ["".join(self._frozen)]
        return (self._frozen[0] if self._frozen else "") + self._head + self._tail

    def push(self, tokens: Sequence[int]) -> str:
        """Add tokens; return the new text that is safe to show."""
        if self.stopped:
            return ""
        before = len(self.tokens)
        self.tokens.extend(tokens)
        window = self._window(len(self.tokens))
        tail = window[len(self._prefix_text):]
        # Positions from here on are relative to _base: `recent` is text[_base:].
        search_from = max(0, self.emitted - self._longest_stop) - self._base
        recent = self._head + tail
        cut = _first_stop(recent, self.stop, search_from)
        if cut is not None:
            # Decoding one token at a time stops at the first token that completes a stop string (vLLM's
            # convention: tokens up to and including it); a batch of tokens (an accepted draft) must end at
            # that same token and cut the text the same way, so speculative and plain runs agree on both.
            for end in range(before + 1, len(self.tokens)):
                shorter = self._head + self._window(end)[len(self._prefix_text):]
                found = _first_stop(shorter, self.stop, search_from)
                if found is not None:
                    recent, cut = shorter, found
                    del self.tokens[end:]
                    break
            self.stopped = True
            self._head, self._tail = recent[:cut], ""
            return self._take(self._base + cut)
        self._tail = tail
        if not tail.endswith("\ufffd"):
            self._commit(window)
        safe = len(recent)
        if recent.endswith("\ufffd"):
            safe = len(recent.rstrip("\ufffd"))
        safe = min(safe, len(recent) - _partial_stop_suffix(recent, self.stop))
        delta = self._take(self._base + safe)
        self._freeze()
        return delta

    def flush(self) -> str:
        """At the end of generation everything not cut by a stop string is released."""
        return self._take(self._base + len(self._head) + len(self._tail))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        recent = self._head + self._tail
        delta = recent[self.emitted - self._base : upto - self._base]
        self.emitted = upto
        return delta

    def _window(self, end: int) -> str:
        """decode(tokens[_prefix:end]): _prefix_text, then the text of tokens[_read:end]."""
        return self.decode(self.tokens[self._prefix : end])

    def _commit(self, window: str) -> None:
        """The tail ends on a whole character: its tokens are decoded for good; move the window up."""
        end = len(self.tokens)
        if end == self._read:
            return  # no new tokens
        self._head += self._tail
        self._tail = ""
        self._read = end
        marks = self._marks
        marks.append(end)
        keep = 0  # the latest boundary at least _CONTEXT_TOKENS back, else the current one
        for i in range(len(marks) - 1, -1, -1):
            if end - marks[i] >= _CONTEXT_TOKENS:
                keep = i
                break
        del marks[:keep]
        if marks[0] == self._prefix:
            self._prefix_text = window
        else:
            self._prefix = marks[0]
            self._prefix_text = self.decode(self.tokens[self._prefix : end])

    def _freeze(self) -> None:
        """Set aside the committed text that no later push searches or hands out."""
        done = max(0, self.emitted - self._longest_stop) - self._base
        done = min(done, len(self._head))
        if done > 0:
            self._frozen.append(self._head[:done])
            self._head = self._head[done:]
            self._base += done


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
