"""Measure what one target pass costs per row count, timed as the engine pays it (forward plus reading the argmax back), and interpolate that curve.

The adaptive k policy needs verify_cost(k + 1) for lengths it has not tried yet. A line through two
measured sizes is wrong on every real machine: a small CPU pays ~0.6 of a pass per extra row, an H200
with CUDA graphs almost nothing up to dozens of rows, and kernels switch at bucket edges. So the
curve is measured once per loaded backend (well under a second on a GPU; on a CPU a few seconds, once
per machine, model, library, threads and mode: cached_pass_costs keeps it on disk) and the policy
reads it. machine_ceiling says what a perfect drafter would buy on that curve.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from specdec.backends.base import embeddable_ids
from specdec.backends.kvcache import release_retained
from specdec.host.paths import measurements_dir

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
    try:
        if context_tokens:
            backend.forward(ids[:context_tokens], cache, num_logits=1)
        rows = ids[context_tokens:]
        sizes = [size for size in sizes if size <= limit]  # larger ones do not fit after the context
        times: dict[int, list[float]] = {size: [] for size in sizes}
        # Rounds over every size, alternating direction, rather than each size's repeats back to back: on a
        # shared VM passes slow down for seconds at a time (one-row passes of 32-55 ms within minutes on the
        # 2-vCPU EPYC), and such a spell then costs each size one sample of its median, instead of moving one
        # size's whole median and with it the curve's shape, which decides the policy's k (one exact-mode curve
        # put a 3-row slice at 2.86 one-row passes, against 1.93-2.73 in four calibrations after it, and that
        # engine drafted nothing).
        for attempt in range(warmup + repeats):
            for size in (sizes if attempt % 2 == 0 else sizes[::-1]):
                began = time.perf_counter()
                logits = backend.forward(rows[:size], cache, num_logits=size)
                torch.argmax(logits, dim=-1).tolist()
                if attempt >= warmup:
                    times[size].append(time.perf_counter() - began)
                cache.trim(size)
        costs: dict[int, float] = {size: statistics.median(times[size]) for size in sizes if times[size]}
    finally:
        cache.trim(cache.length)
    return costs


def interpolate_cost(curve: Mapping[int, float], size: int) -> float:
    """The curve's cost at `size`: piecewise linear between measured sizes, flat below the smallest, and
    beyond the largest along the slope of the last two points (never cheaper than the largest)."""
    return cost_table(curve, [size])[0]


def cost_table(curve: Mapping[int, float], sizes: Sequence[int]) -> list[float]:
    """interpolate_cost(curve, size) for each size (the rule lives here), the curve sorted once: a policy prices
    every k each step."""
    if not curve:
        raise ValueError("an empty cost curve")
    points = sorted(curve.items())
    if len(points) == 1:
        return [points[0][1]] * len(sizes)
    (s_last0, t_last0), (s_last1, t_last1) = points[-2], points[-1]
    tail_slope = (t_last1 - t_last0) / (s_last1 - s_last0)
    out: list[float] = []
    segment = 0
    previous = None
    for size in sizes:
        if size in curve:
            out.append(curve[size])
            continue
        if size <= points[0][0]:
            out.append(points[0][1])
            continue
        if size >= s_last1:
            out.append(max(t_last1, t_last1 + tail_slope * (size - s_last1)))
            continue
        if previous is None or size < previous:
            segment = 0  # sizes are usually increasing: walk on from the last segment, else start over
        while points[segment + 1][0] < size:
            segment += 1
        (s0, t0), (s1, t1) = points[segment], points[segment + 1]
        out.append(t0 + (t1 - t0) * (size - s0) / (s1 - s0))
        previous = size
    return out


def machine_ceiling(curve: Mapping[int, float], max_k: int, draft_cost_ratio: float = 0.0) -> tuple[float, int]:
    """What a drafter whose every token is accepted would buy here: (speedup over plain decoding, its k).

    A step drafting k tokens emits k + 1 and costs one pass of k + 1 rows plus k drafted tokens at
    draft_cost_ratio one-row passes each (0 for a model-free drafter); plain decoding emits 1 per
    one-row pass. The best k in [0, max_k] on the measured curve (k = 0: 1.0, drafting cannot pay).
    """
    one = interpolate_cost(curve, 1)
    best, best_k = 1.0, 0
    for k in range(1, max(0, max_k) + 1):
        speedup = (k + 1) * one / (interpolate_cost(curve, k + 1) + k * draft_cost_ratio * one)
        if speedup > best * (1 + 1e-9):
            best, best_k = speedup, k
    return best, best_k


def _cache_file() -> Path:
    return measurements_dir() / "pass-costs.json"


MEASUREMENT_VERSION = "rounds"  # how measure_pass_costs samples: curves cached by an earlier way are measured again


def _calibration_key(backend) -> str | None:
    key = backend.calibration_key()
    return None if key is None else f"{key}|{MEASUREMENT_VERSION}"


def _read_curves() -> dict:
    """Every cached curve by key ({} when the file is missing or corrupt: that only costs a new measurement)."""
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _write_curves(stored: dict) -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # unwritable: the curve is measured again next time


def cached_pass_costs(backend, sizes: Sequence[int], measure: Callable[[Sequence[int]], dict[int, float]]) -> dict[int, float]:
    """The backend's curve at `sizes`, measured once per machine, model, library, threads and mode.

    The key is backend.calibration_key() (None: nothing cached, always measured). Stored in pass-costs.json in
    $SPECDEC_MEASUREMENTS (default: the model cache); a cached curve missing some sizes is measured again and
    replaced.
    """
    key = _calibration_key(backend)
    if key is None:
        return measure(sizes)
    stored = _read_curves()
    curve = {int(s): float(c) for s, c in stored.get(key, {}).items()}
    if curve and all(int(s) in curve for s in sizes):
        return {int(s): curve[int(s)] for s in sizes}
    curve = measure(sizes)
    stored[key] = {str(s): c for s, c in curve.items()}
    _write_curves(stored)
    return curve


def forget_pass_costs(backend) -> None:
    """Drop the backend's cached curve (measured under other load, say), so the next calibration measures anew."""
    key = _calibration_key(backend)
    stored = _read_curves() if key is not None else {}
    if stored.pop(key, None) is not None:
        _write_curves(stored)


def marginal_row_costs(curve: Mapping[int, float]) -> dict[int, float]:
    """Each measured size's cost as a multiple of a one-row pass (the figure reports print)."""
    base = interpolate_cost(curve, 1)
    return {size: cost / base for size, cost in sorted(curve.items())}


__all__ = ["DEFAULT_CONTEXT", "DEFAULT_SIZES", "cached_pass_costs", "fitting_context", "forget_pass_costs", "interpolate_cost",
           "machine_ceiling", "marginal_row_costs", "measure_pass_costs"]
