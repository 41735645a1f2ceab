"""Regroups a streamed request's tokens into events of exactly N tokens (the last one fewer), so a network
observer cannot read speculation's accepted lengths from how many events come and when."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specdec.engine.output import StepOutput
from specdec.engine.textstream import TextStream


class TokenPacer:
    """Feed it a request's StepOutputs in order; it returns the texts of the events now due, each covering
    exactly `tokens_per_event` generated tokens, and on the last output the rest.

    A step's text comes as one delta for all its tokens, so the pacer decodes the same tokens again, one at a
    time, through its own TextStream with the request's stop strings: the events' texts join to the engine's
    text exactly (the engine ends the tokens at a stop string already; EOS tokens count but show no text)."""

    def __init__(self, tokens_per_event: int, decode: Callable[[Sequence[int]], str], stop: Sequence[str],
                 eos: frozenset[int]):
        if tokens_per_event < 1:
            raise ValueError(f"tokens_per_event must be at least 1, got {tokens_per_event}")
        self.tokens_per_event = tokens_per_event
        self.eos = eos
        self.text = TextStream(decode, stop)
        self._pending: list[str] = []

    def feed(self, output: StepOutput) -> list[str]:
        events = []
        for token in output.tokens:
            self._pending.append("" if token in self.eos else self.text.push([token]))
            if len(self._pending) == self.tokens_per_event:
                events.append("".join(self._pending))
                self._pending.clear()
        if output.finish_reason is not None:
            tail = self.text.flush() if output.finish_reason in ("stop", "length") and not self.text.stopped else ""
            if self._pending or tail:
                events.append("".join(self._pending) + tail)
                self._pending.clear()
        return events
