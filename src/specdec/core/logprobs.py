"""The target's log-probabilities of emitted tokens and their most likely alternatives, read from the verify pass's
rows: row i scored the context up to token i, exactly the row plain decoding scores before choosing that token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target and the `top` most likely tokens there (most likely
    first), from the model's raw distribution: before penalties, logit_bias, a grammar's mask and temperature."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def row_logprobs(rows: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """tokens[i]'s log-probability under rows[i] (log-softmax in float32) and each row's `top` best tokens."""
    if not tokens:
        return []
    scores = torch.log_softmax(rows[: len(tokens)].float(), dim=-1)
    picked = scores[torch.arange(len(tokens)), torch.tensor(list(tokens), dtype=torch.long)].tolist()
    best: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top > 0:
        values, ids = scores.topk(min(top, scores.shape[-1]), dim=-1)
        best = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(int(t), float(p), tuple(b)) for t, p, b in zip(tokens, picked, best)]
