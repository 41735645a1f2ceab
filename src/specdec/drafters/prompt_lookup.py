"""Prompt-lookup drafter: propose the tokens that followed the most recent earlier occurrence of the context's last n tokens (no model).

Deterministic, so drafts carry probs=None: the verifier treats q as one-hot, which is lossless under
greedy and sampling alike. Matching is incremental: an index maps each n-gram to the end of its most
recent occurrence and is extended only with the tokens added since the last call, so a step costs
O(new tokens x n-gram sizes + k), not a scan of the whole context.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from specdec.config import SamplingParams, SpecConfig
from specdec.drafters.base import Draft, Drafter, register_drafter


class NgramIndex:
    """The token sequence so far and, per n, n-gram -> end (exclusive) of its latest occurrence with a token after it."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def reset(self, tokens: Sequence[int] = ()) -> None:
        self.tokens = []
        for table in self.tables.values():
            table.clear()
        self.extend(tokens)

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens and index every n-gram that now has a following token."""
        if not new_tokens:
            return
        tokens = self.tokens
        first_new_end = len(tokens)  # ends e < len(tokens) were usable already; e == len(tokens) becomes usable now
        tokens.extend(int(t) for t in new_tokens)
        last_end = len(tokens) - 1  # an occurrence ending at the last token has no continuation yet
        for n, table in self.tables.items():
            for end in range(max(first_new_end, n), last_end + 1):
                table[tuple(tokens[end - n : end])] = end

    def sync(self, context: Sequence[int]) -> None:
        """Catch up with a context that grew by appending; rebuild if it was rewritten."""
        known = len(self.tokens)
        if len(context) < known or (known and int(context[known - 1]) != self.tokens[-1]) or (
            known and int(context[0]) != self.tokens[0]
        ):
            self.reset(context)
        else:
            self.extend(context[known:])

    def match(self, k: int, min_n: int | None = None) -> tuple[list[int], int]:
        """Up to k tokens continuing the longest (n <= max_n) suffix match, and that n; ([], 0) if none.

        The copy runs on through the tokens it proposes, so a match inside a repeating pattern
        (period shorter than k) still yields k tokens.
        """
        tokens = self.tokens
        length = len(tokens)
        floor = self.min_n if min_n is None else max(min_n, self.min_n)
        if k <= 0:
            return [], 0
        for n in range(min(self.max_n, length), floor - 1, -1):
            end = self.tables[n].get(tuple(tokens[length - n :]))
            if end is None:
                continue
            out: list[int] = []
            for j in range(k):
                pos = end + j
                out.append(tokens[pos] if pos < length else out[pos - length])
            return out, n
        return [], 0


class PromptLookupDrafter(Drafter):
    """Copies continuations from the context itself (prompt lookup decoding; llama.cpp's lookup, vLLM's ngram).

    n-gram sizes come from spec.lookup_max_ngram down to spec.lookup_min_ngram (overridable). The
    drafter keeps no per-draft state: its index only ever holds the engine's context, which contains
    accepted tokens only, so there is nothing to roll back.
    """

    name = "prompt_lookup"
    can_spawn = True

    def __init__(self, spec: SpecConfig | None = None, min_ngram: int | None = None, max_ngram: int | None = None):
        self.spec = spec or SpecConfig(drafter=self.name)
        self.index = NgramIndex(
            min_ngram if min_ngram is not None else self.spec.lookup_min_ngram,
            max_ngram if max_ngram is not None else self.spec.lookup_max_ngram,
        )
        self.last_match_length = 0  # n of the last successful match (0: none)
        self.num_lookups = 0
        self.num_matches = 0

    def spawn(self) -> "PromptLookupDrafter":
        """A drafter of the same configuration for another sequence running at the same time."""
        return PromptLookupDrafter(self.spec, self.index.min_n, self.index.max_n)

    def begin(self, prompt: Sequence[int], params: SamplingParams | None = None, generator: torch.Generator | None = None) -> None:
        self.index.reset(prompt)
        self.last_match_length = 0

    def lookup(self, context: Sequence[int], k: int, min_n: int | None = None) -> list[int]:
        """The lookup itself (no timing): sync the index with context and return up to k copied tokens."""
        self.index.sync(context)
        tokens, n = self.index.match(k, min_n)
        self.num_lookups += 1
        self.num_matches += bool(tokens)
        self.last_match_length = n
        return tokens

    def next_source(self, context: Sequence[int]) -> str | None:
        """'ngram<n>' for the match the next propose() will copy from (longer matches are accepted more
        often, so each size gets its own k policy), None when nothing matches."""
        self.index.sync(context)
        _, n = self.index.match(1)
        return f"ngram{n}" if n else None

    def plan(self, context: Sequence[int]) -> list[int]:
        """The draft propose() would copy at the largest k (the engine scores it against what follows)."""
        self.index.sync(context)
        tokens, _ = self.index.match(self.spec.num_speculative_tokens)
        return tokens

    def propose(self, context: Sequence[int], k: int) -> Draft:
        began = time.perf_counter()
        tokens = self.lookup(context, k)
        return Draft(tokens, None, time.perf_counter() - began)

    def accepted(self, num_accepted: int, num_proposed: int) -> None:
        pass  # nothing speculative is stored

    def end(self) -> None:
        pass


register_drafter(
    "prompt_lookup",
    lambda draft_backend=None, spec=None, **kw: PromptLookupDrafter(spec, **kw),
)

__all__ = ["NgramIndex", "PromptLookupDrafter"]
