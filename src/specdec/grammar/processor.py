"""One request's grammar as a LogitsProcessor: llguidance's matcher masks each row, advances through the draft and
rolls back to the verdict; the tokens the grammar forces next are offered as a free draft."""

from __future__ import annotations

import llguidance
import llguidance.torch
import torch

from specdec.grammar.errors import GrammarError, first_line


class GrammarProcessor:
    """Masks every token the grammar does not allow after the current state (the target's EOS ids are allowed
    exactly where the grammar may end; where it must end, only they are). advance() consumes a token, rollback()
    undoes consumed tokens; an EOS ends the text, so it is counted, not consumed."""

    def __init__(self, compiler, compiled):
        self._apply_mask = llguidance.torch.apply_token_bitmask_inplace
        self._fill_mask = llguidance.torch.fill_next_token_bitmask
        self.matcher = llguidance.LLMatcher(compiler.tokenizer, compiled.grammar, log_level=0,
                                            limits=compiler.limits())
        if self.matcher.is_error():
            raise GrammarError(f"the grammar could not be built: {first_line(self.matcher.get_error())}")
        self.eos = frozenset(compiler.eos_token_ids)
        self.vocab_size = compiler.vocab_size
        self.mask = llguidance.torch.allocate_token_bitmask(1, compiler.vocab_size)
        self.ended = 0  # EOS tokens advanced through (at most one: the text ends there)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        out = logits.float().clone().unsqueeze(0)
        if not self.ended:  # past an EOS the row is never read (the text ends there): left as it is, finite
            self._fill_mask(self.matcher, self.mask, 0)
            self._apply_mask(out, self.mask)
        return out[0]

    def accepts(self, token: int) -> bool:
        if self.ended:
            return False
        if token in self.eos:
            return self.matcher.is_accepting()
        return self.matcher.validate_tokens([int(token)]) == 1

    def advance(self, token: int) -> None:
        if self.ended or (token in self.eos and self.matcher.is_accepting()):
            self.ended += 1
            return
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} does not follow the grammar: {first_line(self.matcher.get_error())}")

    def rollback(self, count: int) -> None:
        undo_end = min(count, self.ended)
        self.ended -= undo_end
        if count - undo_end and not self.matcher.rollback(count - undo_end):
            raise GrammarError(f"the grammar could not roll back {count - undo_end} tokens")

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (llguidance's fast-forward tokens), a free draft."""
        if self.ended or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())

    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole sentence of the grammar (an EOS may follow)."""
        return self.ended > 0 or self.matcher.is_accepting()


__all__ = ["GrammarProcessor"]
