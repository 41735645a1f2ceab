"""A first-order Markov 'model' behind the ModelBackend protocol: exact next-token distributions, microsecond forwards.

Used where a test needs thousands of generations (distribution checks) or a draft whose confidence is
known exactly (draft_p_min), which random-weight transformers cannot give cheaply.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch

from specdec.backends.base import ModelBackend


class MarkovCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def trim(self, n: int) -> int:
        n = max(0, min(n, len(self.tokens)))
        del self.tokens[len(self.tokens) - n :]
        return n


class MarkovBackend(ModelBackend):
    """logits for the next token depend only on the current one: table[V, V] of logits."""

    def __init__(self, table: torch.Tensor, max_context: int = 256, eos_token_ids: Sequence[int] = ()):
        self.table = table.float()
        self.vocab_size = int(table.shape[0])
        self.max_context = max_context
        self.eos_token_ids = frozenset(eos_token_ids)
        self.forward_calls = 0
        self.forward_tokens = 0

    def new_cache(self, capacity: int | None = None) -> MarkovCache:
        return MarkovCache(capacity or self.max_context)

    def forward(self, tokens: Sequence[int], cache: MarkovCache, num_logits: int = 1) -> torch.Tensor:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("forward needs at least one token")
        if cache.length + len(tokens) > cache.capacity:
            raise ValueError("cache overflow")
        cache.tokens.extend(tokens)
        self.forward_calls += 1
        self.forward_tokens += len(tokens)
        num_logits = max(1, min(num_logits, len(tokens)))
        return self.table[tokens[-num_logits:]].clone()

    def probs(self, temperature: float = 1.0) -> torch.Tensor:
        return torch.softmax(self.table / temperature, dim=-1)


def random_table(vocab: int, seed: int, scale: float = 1.5, boost: dict[int, int] | None = None,
                 boost_by: float = 2.0) -> torch.Tensor:
    """Random logits; boost maps token -> favoured successor (to make a pattern the chain tends to follow)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab, vocab, generator=g) * scale
    for a, b in (boost or {}).items():
        table[a, b] += boost_by
    return table


def sequence_distribution(probs: torch.Tensor, start: int, length: int) -> dict[tuple[int, ...], float]:
    """Exact P(x1..x_length | previous token = start) under the chain."""
    vocab = probs.shape[0]
    out = {}
    for seq in itertools.product(range(vocab), repeat=length):
        p, prev = 1.0, start
        for t in seq:
            p *= float(probs[prev, t])
            prev = t
        out[seq] = p
    return out


def sampled_counts(engine, prompt: Sequence[int], params: dict, draws: int):
    """Generate once per seed 0..draws-1; return (Counter of output tuples, accepted tokens, drafted tokens)."""
    from collections import Counter

    from specdec.config import SamplingParams

    counts: Counter = Counter()
    accepted = drafted = 0
    for seed in range(draws):
        result = engine.generate(prompt, SamplingParams(seed=seed, **params))
        counts[tuple(result.tokens)] += 1
        accepted += result.stats.num_accepted_tokens
        drafted += result.stats.num_draft_tokens
    return counts, accepted, drafted


def chi_square_pvalue(counts: dict, expected: dict[tuple[int, ...], float], total: int) -> float:
    """Pearson chi-square goodness of fit, pooling cells with expected count < 5 into one."""
    from scipy.stats import chi2

    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for seq, p in expected.items():
        e = p * total
        o = counts.get(seq, 0)
        if e < 5:
            pooled_obs += o
            pooled_exp += e
            continue
        stat += (o - e) ** 2 / e
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    return float(chi2.sf(stat, max(dof, 1)))


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors: OpenMP fan-out only costs (milliseconds per op on a busy 2-core box); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
