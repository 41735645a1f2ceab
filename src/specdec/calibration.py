"""Measure what one target pass costs per row count, timed as the engine pays it (forward plus reading the argmax back), and interpolate that curve.

The adaptive k policy needs verify_cost(k + 1) for lengths it has not tried yet. A line through two
measured sizes is wrong on every real machine: a small CPU pays ~0.6 of a pass per extra row, an H200
with CUDA graphs almost nothing up to dozens of rows, and kernels switch at bucket edges. So the
curve is measured once per loaded backend (well under a second on a GPU) and the policy reads it.
"""

from __future__ import annotations

import statistics
import time
from typing import Mapping, Sequence

import torch

from .backends.base import embeddable_ids
from .kvcache import release_retained

DEFAULT_SIZES = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64)
DEFAULT_CONTEXT = 256


def fitting_context(capacity: int, wanted: int = DEFAULT_CONTEXT) -> int:
    """The cached tokens a measurement runs after: `wanted`, but at most half the cache, leaving room for the rows."""
    return min(wanted, capacity // 2)


def measure_pass_costs(backend, sizes: Sequence[int] = DEFAULT_SIZES, context_tokens: int = DEFAULT_CONTEXT,
                       repeats: int = 5, warmup: int = 2, cache=None, seed: int = 0) -> dict[int, float]:
    """Median seconds of one pass of n rows after `context_tokens` cached tokens, for each n in sizes.

    Each timed pass is a forward plus the host reading its argmax (one device synchronisation, as
    the engine's verification does), and is rolled back afterwards. `cache` reuses a cache the caller
    owns (it is emptied before and after; sizes that do not fit in it are left out); otherwise one is
    made for the measurement. Prefixes that idle engines and drafters keep on the backend are
    dropped first (llama.cpp's caches share one KV memory; the measurement needs its room).
    """
    sizes = sorted({int(s) for s in sizes if int(s) >= 1})
    capacity = context_tokens + max(sizes) + 1
    release_retained(backend)
    if cache is None:
        cache = backend.new_cache(min(capacity, backend.max_context))
    context_tokens = fitting_context(cache.capacity, context_tokens)
    limit = cache.capacity - context_tokens  # sizes that do not fit after the context are not measured
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, embeddable_ids(backend), (context_tokens + max(sizes),), generator=generator).tolist()
    cache.trim(cache.length)
    costs: dict[int, float] = {}
    try:
        if context_tokens:
            backend.forward(ids[:context_tokens], cache, num_logits=1)
        rows = ids[context_tokens:]
        for size in sizes:
            if size > limit:
                break
            times = []
            for attempt in range(warmup + repeats):
                began = time.perf_counter()
                logits = backend.forward(rows[:size], cache, num_logits=size)
                torch.argmax(logits, dim=-1).tolist()
                if attempt >= warmup:
                    times.append(time.perf_counter() - began)
                cache.trim(size)
            costs[size] = statistics.median(times)
    finally:
        cache.trim(cache.length)
    return costs


def interpolate_cost(curve: Mapping[int, float], size: int) -> float:
    """The curve's cost at `size`: piecewise linear between measured sizes, flat below the smallest, and
    beyond the largest along the slope of the last two points (never cheaper than the largest)."""
    if not curve:
        raise ValueError("an empty cost curve")
    points = sorted(curve.items())
    if size in curve:
        return curve[size]
    if size <= points[0][0]:
        return points[0][1]
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if s0 <= size <= s1:
            return t0 + (t1 - t0) * (size - s0) / (s1 - s0)
    if len(points) == 1:
        return points[-1][1]
    (s0, t0), (s1, t1) = points[-2], points[-1]
    return max(t1, t1 + (t1 - t0) / (s1 - s0) * (size - s1))


def marginal_row_costs(curve: Mapping[int, float]) -> dict[int, float]:
    """Each measured size's cost as a multiple of a one-row pass (the figure reports print)."""
    base = interpolate_cost(curve, 1)
    return {size: cost / base for size, cost in sorted(curve.items())}


__all__ = ["DEFAULT_CONTEXT", "DEFAULT_SIZES", "fitting_context", "interpolate_cost", "marginal_row_costs", "measure_pass_costs"]
