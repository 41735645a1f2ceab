"""The logits-processor seam: a request's stateful transform of the target's logits, advanced through a draft row by
row and rolled back to the accepted prefix, so every verified row gets what plain decoding applies after its prefix."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class LogitsProcessor(Protocol):
    """One request's processor. Its state is the tokens it has been advanced through since the prompt.

    Plain decoding calls apply() once per token, then advance(token). A verify pass calls apply() at row i after
    advancing through the first i draft tokens, and rollback() to the accepted prefix afterwards (xgrammar's
    matcher and llguidance work the same way), so row i's transform is exactly plain decoding's after that prefix.
    """

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The transformed scores of one row [V] after the current state; never changes `logits` itself."""
        ...

    def accepts(self, token: int) -> bool:
        """Whether `token` may follow the current state (a grammar says no to tokens that leave it; penalties
        accept every token)."""
        ...

    def advance(self, token: int) -> None:
        """Move the state past `token` (an accepted one)."""
        ...

    def rollback(self, count: int) -> None:
        """Undo the last `count` advances."""
        ...

    def forced(self) -> list[int]:
        """Tokens that must come next whatever the model says (a grammar's fixed text), offered as a free draft and
        verified like any other; [] when nothing is forced (penalties never force)."""
        ...


class ProcessorChain:
    """Several processors as one, applied in order (each sees the previous one's scores); a token is accepted only
    when every processor accepts it."""

    def __init__(self, processors: Sequence[LogitsProcessor]):
        if not processors:
            raise ValueError("a processor chain needs at least one processor")
        self.processors = list(processors)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for processor in self.processors:
            logits = processor.apply(logits)
        return logits

    def accepts(self, token: int) -> bool:
        return all(processor.accepts(token) for processor in self.processors)

    def advance(self, token: int) -> None:
        for processor in self.processors:
            processor.advance(token)

    def rollback(self, count: int) -> None:
        for processor in self.processors:
            processor.rollback(count)

    def forced(self) -> list[int]:
        for processor in self.processors:
            tokens = processor.forced()
            if tokens:
                return tokens[: allowed_draft_length(self, tokens, keep_first_forbidden=False)]
        return []


def chain(processors: Sequence[LogitsProcessor | None]) -> LogitsProcessor | None:
    """The processors that are there, as one (None when there are none: the engine's unprocessed fast path)."""
    present = [p for p in processors if p is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else ProcessorChain(present)


def process_rows(processor: LogitsProcessor, logits: torch.Tensor, proposed: Sequence[int]) -> tuple[torch.Tensor, int]:
    """The verify pass's rows [R, V] transformed: row i after the state advanced through proposed[:i]; and how many
    draft tokens the state advanced through.

    R may be smaller than len(proposed) + 1 (a greedy verification that stopped at its first departure): only the
    rows there are processed. A draft token the processor does not accept (a sampled draft keeps its first such
    token: allowed_draft_length) ends the advance: its own row rejects it (its score is masked), so the rows after
    it are never read; they get a copy of its row, a valid distribution. settle() then rolls the state back to the
    verdict."""
    rows = logits.shape[0]
    if rows - 1 > len(proposed):
        raise ValueError(f"{rows} rows but only {len(proposed)} proposed tokens")
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    advanced = 0
    for i in range(rows):
        out[i] = processor.apply(logits[i])
        if i == rows - 1:
            break
        token = int(proposed[i])
        if not processor.accepts(token):
            out[i + 1:] = out[i]
            break
        processor.advance(token)
        advanced += 1
    return out, advanced


def settle(processor: LogitsProcessor, advanced: int, num_accepted: int, next_token: int) -> None:
    """After process_rows advanced through `advanced` draft tokens: keep the accepted ones (never more than were
    advanced through: a token the processor refused is masked, so never accepted), then take next_token."""
    if not 0 <= num_accepted <= advanced:
        raise ValueError(f"accepted {num_accepted} of {advanced} advanced tokens")
    processor.rollback(advanced - num_accepted)
    processor.advance(int(next_token))


def allowed_draft_length(processor: LogitsProcessor, tokens: Sequence[int], keep_first_forbidden: bool) -> int:
    """How much of a draft the processor lets through: up to its first token that leaves the processor's language.

    A deterministic draft (no q) is cut before that token: its row would be rejected anyway, and the residual is
    then p itself, so cutting changes nothing in distribution. A sampled draft (a draft model's q) keeps it: cut,
    the emitted token would be drawn from p instead of norm(max(p - q, 0)), which is not exact; kept, its p is 0
    after the processor, so the rejection rule rejects it and draws from the residual. The state is left as found.
    """
    advanced = 0
    try:
        for token in tokens:
            if not processor.accepts(int(token)):
                return advanced + (1 if keep_first_forbidden else 0)
            processor.advance(int(token))
            advanced += 1
        return advanced
    finally:
        processor.rollback(advanced)


__all__ = ["LogitsProcessor", "ProcessorChain", "allowed_draft_length", "chain", "process_rows", "settle"]
