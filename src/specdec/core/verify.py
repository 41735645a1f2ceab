"""Pure acceptance rules: given a draft and the target's distributions, how many draft tokens survive and what comes next."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdec.core.sampling import sample_rows


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
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023), on the probabilities' device.

    draft_tokens: [k]; draft_probs: [k, V] or None (deterministic draft: q is one-hot on the
    token, so acceptance probability is p(x) and the residual is p with x removed);
    target_probs: [k + 1, V]. The emitted sequence is distributed exactly as the target's.

    Position i is accepted when u_i * q(x_i) < p(x_i), u_i ~ U[0, 1); the first rejected position n
    (k when none is) emits a draw from norm(max(p_n - q_n, 0)), the bonus row's residual being p_k
    itself. All k tests and the one draw run as tensor operations, and the host reads two numbers
    once: on a GPU, one synchronisation per step (vLLM's rejection sampler works the same way).
    """
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"need k + 1 = {k + 1} target rows, got {target_probs.shape[0]}")
    if draft_probs is not None and draft_probs.shape[0] != k:
        raise ValueError(f"need k = {k} draft rows, got {draft_probs.shape[0]}")
    device = target_probs.device
    vocab = target_probs.shape[-1]
    tokens = torch.as_tensor([int(t) for t in draft_tokens], dtype=torch.long).to(device)
    rows = torch.arange(k, device=device)
    p_x = target_probs[rows, tokens].double()
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[rows, tokens].double()
    u = torch.rand(k, generator=generator, dtype=torch.float64, device=_generator_device(generator, device))
    # q_x == 0 cannot be drawn by an honest sampler; rejecting keeps the rule safe if it happens.
    rejected = ~((q_x > 0.0) & (u.to(device) * q_x < p_x))
    first = torch.cat([rejected, rejected.new_ones(1)]).to(torch.int64).argmax().view(1)  # n in [0, k]
    p_n = target_probs.index_select(0, first)[0].float()
    if draft_probs is None:
        # q_n is one-hot on x_n (nothing at the bonus row): the residual is p_n with x_n removed.
        token_n = torch.cat([tokens, tokens.new_zeros(1)]).index_select(0, first)
        q_n = torch.zeros(vocab, dtype=torch.float32, device=device).scatter_(
            0, token_n, (first < k).to(torch.float32))
    else:
        q_n = torch.cat([draft_probs.float(), draft_probs.new_zeros(1, vocab, dtype=torch.float32)]).index_select(
            0, first)[0]
    residual = torch.clamp(p_n - q_n, min=0.0)
    # p <= q everywhere means p == q, so rejection has probability 0; guard rounding only.
    residual = torch.where(residual.sum() > 0.0, residual, p_n)
    next_token = sample_rows(residual, generator).view(1)
    num_accepted, token = torch.cat([first, next_token]).tolist()
    return Verdict(num_accepted, token, is_bonus=num_accepted == k)


def _generator_device(generator: torch.Generator | None, fallback: torch.device) -> torch.device:
    return generator.device if generator is not None else fallback
