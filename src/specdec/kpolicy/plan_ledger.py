"""PlanLedger: score a deterministic drafter's plans against the tokens that really follow them, so a k policy learns acceptance at every step, whether it drafted or not.

Why this is exact. A model-free drafter (suffix trie, prompt lookup) proposes a function of the context alone:
its plan at a step is the draft it would propose at the largest k. Verifying a one-hot draft token x accepts it
with probability p(x) (greedy: when x is the argmax), and the target, decoding on, emits x at that position with
the same probability, whatever was drafted (the output is target-distributed). So "the plan's i-th token equals
the i-th token that followed, given the ones before it matched" is an event with exactly the distribution of
"draft position i is accepted, given it was reached", observed without spending a verified row on it.

The policy then needs no exploratory drafts to learn acceptance (on a CPU an exploratory row costs 0.5-0.6 of a
one-row pass, measured), and learns every position up to the plan's length, not only those it drafted.

Plans are resolved position by position as the context grows: a match is evidence "accepted", the first
mismatch is evidence "rejected" and ends the plan; positions the request never reached teach nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class AcceptanceLearner(Protocol):
    """What a plan teaches: position i (0-based) of a draft was reached and accepted or not."""

    def observe(self, position: int, accepted: bool) -> None: ...


class PlanLedger:
    """The plans of one sequence still waiting for the tokens that decide them.

    add(start, tokens, learner): a plan made when the context had `start` tokens; resolve(context) feeds each
    pending plan's newly decided positions to its learner. At most `limit` plans wait (the oldest go first):
    a plan waits only while all its decided positions matched, so in practice few do.
    """

    def __init__(self, limit: int = 64):
        self.limit = limit
        self._pending: list[list] = []  # [start, tokens, learner, next position]

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, start: int, tokens: Sequence[int], learner: AcceptanceLearner) -> None:
        if not tokens:
            return
        if len(self._pending) >= self.limit:
            del self._pending[0]
        self._pending.append([start, list(tokens), learner, 0])

    def resolve(self, context: Sequence[int]) -> None:
        known = len(context)
        still: list[list] = []
        for entry in self._pending:
            start, tokens, learner, position = entry
            while position < len(tokens) and start + position < known:
                matched = int(context[start + position]) == tokens[position]
                learner.observe(position, matched)
                position += 1
                if not matched:
                    position = -1
                    break
            if 0 <= position < len(tokens):
                entry[3] = position
                still.append(entry)
        self._pending = still


__all__ = ["AcceptanceLearner", "PlanLedger"]
