"""Divergences between a target's top-K distribution and a draft's full distribution, as pure tensor functions.

The target side is stored sparsely: for every continuation position, the K most likely token ids and
their log-probabilities renormalised over those K ids (p is taken to be 0 elsewhere). The draft side is
the draft's full log-softmax. Both losses are exact under that sparse p:
- forward KL(p || q) = sum_{j in K} p_j (log p_j - log q_j), the usual distillation loss;
- total variation TV(p, q) = 1/2 sum_v |p_v - q_v| = 1 - sum_{j in K} min(p_j, q_j), whose complement
  1 - TV is the probability that one sampled draft token is accepted (Leviathan et al.), which is why
  DistillSpec offers it.
"""

from __future__ import annotations

import torch

LOSSES = ("fkl", "tvd")


def topk_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, vocab] -> (ids [n, K] long, log-probs [n, K] float32 renormalised over the K ids)."""
    k = min(k, logits.shape[-1])
    values, ids = torch.topk(logits.float(), k, dim=-1)
    return ids, torch.log_softmax(values, dim=-1)


def restrict_to_vocab(ids: torch.Tensor, log_probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """Log-probs with ids the draft cannot score (>= vocab: a padded target head) removed and renormalised.

    Returns new log-probs; removed entries get -inf (p = 0) and are skipped by the losses.
    """
    valid = ids < vocab
    if bool(valid.all()):
        return log_probs
    masked = log_probs.masked_fill(~valid, float("-inf"))
    return masked - torch.logsumexp(masked, dim=-1, keepdim=True)


def forward_kl(draft_log_probs: torch.Tensor, target_ids: torch.Tensor, target_log_probs: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p || q); draft_log_probs [n, vocab], target_* [n, K]."""
    log_q = draft_log_probs.gather(-1, target_ids.clamp_max(draft_log_probs.shape[-1] - 1))
    p = target_log_probs.exp()
    log_p = target_log_probs.masked_fill(p == 0, 0.0)  # 0 * log 0 = 0, without a NaN in the graph
    return (p * (log_p - log_q)).sum(-1).mean()


def total_variation(
    draft_log_probs: torch.Tensor, target_ids: torch.Tensor, target_log_probs: torch.Tensor
) -> torch.Tensor:
    """Mean over positions of TV(p, q) = 1 - sum_v min(p_v, q_v); draft_log_probs [n, vocab], target_* [n, K]."""
    q = draft_log_probs.gather(-1, target_ids.clamp_max(draft_log_probs.shape[-1] - 1)).exp()
    p = target_log_probs.exp()
    q = torch.where(p > 0, q, torch.zeros_like(q))  # an id that was dropped is not part of p's support
    return (1.0 - torch.minimum(p, q).sum(-1)).mean()


def divergence(name: str, draft_log_probs: torch.Tensor, target_ids: torch.Tensor,
               target_log_probs: torch.Tensor) -> torch.Tensor:
    """The loss called `name` ("fkl" or "tvd")."""
    if name == "fkl":
        return forward_kl(draft_log_probs, target_ids, target_log_probs)
    if name == "tvd":
        return total_variation(draft_log_probs, target_ids, target_log_probs)
    raise ValueError(f"unknown loss {name!r}; choose from {', '.join(LOSSES)}")


__all__ = ["LOSSES", "divergence", "forward_kl", "restrict_to_vocab", "topk_log_probs", "total_variation"]
