"""logit_bias, OpenAI's presence and frequency penalties and llama.cpp's repetition penalty as one LogitsProcessor
whose state is the tokens generated so far (and the prompt's tail, for the repetition window)."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from specdec.config import SamplingParams


class PenaltyProcessor:
    """Applies, in this order, to the raw logits of each row:

    1. logit_bias: the bias added to each listed id's logit (OpenAI; before any penalty, as vLLM does).
    2. repetition_penalty r (llama.cpp's penalties sampler, CTRL's rule): every id present in the last
       repeat_last_n tokens of prompt + output has its logit divided by r when positive, multiplied by r otherwise.
    3. presence and frequency penalties (OpenAI's definition): logit[j] -= frequency * c[j] + presence * (c[j] > 0),
       c[j] the number of times j was generated so far (the output only, as OpenAI and vLLM count).

    The state is the generated tokens; advance() and rollback() move along them, so a verify pass's row i sees
    the counts of its own prefix, not the whole draft's (DESIGN.md section 9).
    """

    def __init__(self, params: SamplingParams, prompt: Sequence[int], vocab_size: int):
        self.params = params
        self.vocab_size = vocab_size
        window = params.repeat_last_n
        self.window = 0 if params.repetition_penalty == 1.0 else window
        # The prompt matters only to the repetition window; keep just the tail the window can reach.
        self.prompt_tail = [int(t) for t in prompt][-self.window:] if self.window > 0 else (
            [int(t) for t in prompt] if self.window < 0 else [])
        self.generated: list[int] = []
        self.counts: Counter[int] = Counter()
        if params.logit_bias:
            ids = [token for token, _ in params.logit_bias]
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"logit_bias has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
            self.bias_ids = torch.tensor(ids, dtype=torch.long)
            self.bias_values = torch.tensor([bias for _, bias in params.logit_bias], dtype=torch.float32)
        else:
            self.bias_ids = None
        self.counted = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0

    def _window_ids(self) -> list[int]:
        if self.window == 0:
            return []
        recent = self.prompt_tail + self.generated
        if self.window > 0:
            recent = recent[-self.window:]
        return sorted(set(recent))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        out = logits.float().clone()
        if self.bias_ids is not None:
            out.index_add_(0, self.bias_ids.to(out.device), self.bias_values.to(out.device))
        repeated = self._window_ids()
        if repeated:
            ids = torch.tensor(repeated, dtype=torch.long, device=out.device)
            values = out.index_select(0, ids)
            penalty = self.params.repetition_penalty
            out.index_copy_(0, ids, torch.where(values > 0, values / penalty, values * penalty))
        if self.counted and self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long, device=out.device)
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32, device=out.device)
            out.index_add_(0, ids, -(self.params.frequency_penalty * counts + self.params.presence_penalty))
        return out

    def accepts(self, token: int) -> bool:
        return True

    def forced(self) -> list[int]:
        return []

    def advance(self, token: int) -> None:
        self.generated.append(int(token))
        self.counts[int(token)] += 1

    def rollback(self, count: int) -> None:
        if count < 0 or count > len(self.generated):
            raise ValueError(f"cannot roll back {count} of {len(self.generated)} generated tokens")
        for _ in range(count):
            token = self.generated.pop()
            self.counts[token] -= 1
            if not self.counts[token]:
                del self.counts[token]


def penalty_processor(params: SamplingParams, prompt: Sequence[int], vocab_size: int) -> PenaltyProcessor | None:
    """The request's PenaltyProcessor, or None when every option is neutral (the engine then skips the seam)."""
    if not params.logit_bias and params.repetition_penalty == 1.0 and not params.presence_penalty \
            and not params.frequency_penalty:
        return None
    return PenaltyProcessor(params, prompt, vocab_size)


__all__ = ["PenaltyProcessor", "penalty_processor"]
