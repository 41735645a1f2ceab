"""Pure acceptance rules: given a draft and the target's distributions, how many draft tokens survive and what comes next."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .sampling import sample_token


@dataclass(frozen=True)
class Verdict:
    """num_accepted draft tokens are kept, then next_token (recovered at a rejection, or the bonus)."""

    num_accepted: int
    next_token: int
    is_bonus: bool


def verify_greedy(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> Verdict:
    """Accept while the draft equals the target's argmax.

    draft_tokens: [k]; target_argmax: [k + 1], the target's greedy choice after each prefix.
    """
    k = len(draft_tokens)
    if len(target_argmax) != k + 1:
        raise ValueError(f"need k + 1 = {k + 1} target choices, got {len(target_argmax)}")
    for i, token in enumerate(draft_tokens):
        if int(token) != int(target_argmax[i]):
            return Verdict(i, int(target_argmax[i]), is_bonus=False)
    return Verdict(k, int(target_argmax[k]), is_bonus=True)


def verify_sampled(
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    draft_tokens: [k]; draft_probs: [k, V] or None (deterministic draft: q is one-hot on the
    token, so acceptance probability is p(x) and the residual is p with x removed);
    target_probs: [k + 1, V]. The emitted sequence is distributed exactly as the target's.
    """
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"need k + 1 = {k + 1} target rows, got {target_probs.shape[0]}")
    if draft_probs is not None and draft_probs.shape[0] != k:
        raise ValueError(f"need k = {k} draft rows, got {draft_probs.shape[0]}")
    for i, token in enumerate(draft_tokens):
        token = int(token)
        p_row = target_probs[i]
        p_x = float(p_row[token])
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, token])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        # q_x == 0 cannot be drawn by an honest sampler; rejecting keeps the rule safe if it happens.
        if q_x > 0.0 and u * q_x < p_x:
            continue
        if draft_probs is None:
            residual = p_row.clone()
            residual[token] = 0.0
        else:
            residual = torch.clamp(p_row - draft_probs[i], min=0.0)
        total = float(residual.sum())
        if total <= 0.0:
            # p <= q everywhere means p == q, so rejection has probability 0; guard rounding only.
            residual, total = p_row, float(p_row.sum())
        return Verdict(i, sample_token(residual / total, generator), is_bonus=False)
    return Verdict(k, sample_token(target_probs[k], generator), is_bonus=True)
