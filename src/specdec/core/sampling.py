"""One logits -> probabilities transform (temperature, top-k, top-p, min-p), applied identically to draft and target."""

from __future__ import annotations

import numpy as np
import torch

from specdec.config import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [..., V] into the sampling distribution [..., V] (float32, rows sum to 1).

    Each row is transformed independently, so a row's result does not depend on which other
    positions were batched with it: the draft's q and the target's p see exactly the same rule.
    Greedy (temperature 0) is not a distribution; callers use `greedy_tokens` for it.
    """
    if params.greedy:
        raise ValueError("greedy sampling has no distribution; use greedy_tokens()")
    scores = logits.float()
    # Shift so the largest score is 0 before dividing: softmax is unchanged, and a temperature as small
    # as 1e-39 gives -inf, not inf - inf = NaN: the T -> 0 limit, greedy. A temperature float32 cannot
    # hold (below ~1.2e-38, which would round to 0 and give 0 / 0) is applied in float64.
    scores = scores - scores.amax(dim=-1, keepdim=True)
    if params.temperature < torch.finfo(torch.float32).tiny:
        scores = (scores.double() / params.temperature).float()
    else:
        scores = scores / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p; the top token is always kept.
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the vocabulary, ties to the lowest id (same as torch.argmax and HF greedy).

    A float32 CPU tensor goes through numpy: over a 151,936-id row torch.argmax took 130 us and np.argmax 11 us
    on the 2-vCPU EPYC, once per decoding step (0.4% of a 1.5B model's one-row pass). Same answer, NaN included
    (both take the first NaN as the largest).
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(np.asarray(np.argmax(logits.numpy(), axis=-1)))
    return torch.argmax(logits, dim=-1)


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one id per row of probs [..., V] (unnormalised weights are fine), on probs' device, without a host sync.

    The exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks id i with probability p_i / sum(p)
    (torch.multinomial's own one-sample path). Ids with p = 0 are never drawn while any p > 0.
    """
    noise = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return torch.argmax(probs.float() / noise.clamp_min_(torch.finfo(torch.float32).tiny), dim=-1)


def sample_token(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D distribution."""
    return int(sample_rows(probs, generator))


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed for one output position of a request with `seed`: splitmix64's mixer over (seed,
    position), so the noise drawn there depends on those two numbers and on nothing else."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits: manual_seed takes it on every device


def positional_choices(probs: torch.Tensor, seed: int, first_position: int) -> list[int]:
    """One draw per row of probs [rows, V], row i being output position first_position + i, each by the
    exponential race with its own (seed, position) noise: exactly p-distributed per position, independent across
    positions, and the same token at a position whatever was drafted, verified or batched before it."""
    choices = []
    for i in range(probs.shape[0]):
        generator = torch.Generator(device=probs.device)
        generator.manual_seed(position_seed(seed, first_position + i))
        choices.append(int(sample_rows(probs[i], generator)))
    return choices


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` (the logits' device: a CPU generator cannot drive sampling on CUDA tensors),
    seeded from the request, or from fresh entropy when seed is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
