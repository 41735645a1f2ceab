"""Probe: how much the calibrated pass-cost curve moves between calibrations, sizes measured size by size (the
old order) against rounds over every size (calibration.measure_pass_costs now), on the default target.

    PYTHONPATH=src python benchmarks/epyc-2core/calibration_rounds_probe.py [trials] [threads]

Alternates the two orders, `trials` calibrations each, for the fast and the exact kernels, with the backend's own
calibration options (llama.cpp: 3 timed passes per size after 1 warm-up). Prints each trial's curve as multiples
of its one-row pass, which is what the k policy reads (its level is rescaled to the engine's own passes).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from specdec.backends.base import embeddable_ids
from specdec.backends.llamacpp_backend import LlamaCppBackend
from specdec.calibration import DEFAULT_CONTEXT, measure_pass_costs

SIZES = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33)
GGUF = Path.home() / ".cache/specdec/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"


def size_by_size(backend, cache, repeats: int, warmup: int) -> dict[int, float]:
    """The order measure_pass_costs used before rounds: each size's warm-up and repeats back to back."""
    ids = torch.randint(0, embeddable_ids(backend), (DEFAULT_CONTEXT + max(SIZES),),
                        generator=torch.Generator().manual_seed(0)).tolist()
    cache.trim(cache.length)
    backend.forward(ids[:DEFAULT_CONTEXT], cache, num_logits=1)
    rows, costs = ids[DEFAULT_CONTEXT:], {}
    for size in SIZES:
        times = []
        for attempt in range(warmup + repeats):
            began = time.perf_counter()
            torch.argmax(backend.forward(rows[:size], cache, num_logits=size), dim=-1).tolist()
            if attempt >= warmup:
                times.append(time.perf_counter() - began)
            cache.trim(size)
        costs[size] = statistics.median(times)
    cache.trim(cache.length)
    return costs


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    for exact in (False, True):
        backend = LlamaCppBackend(GGUF, max_context=512, threads=threads, batch_invariant=exact)
        options = backend.calibration_options
        cache = backend.new_cache(512)
        curves: dict[str, list[dict[int, float]]] = {"size by size": [], "rounds": []}
        for _ in range(trials):
            curves["size by size"].append(size_by_size(backend, cache, **options))
            curves["rounds"].append(measure_pass_costs(backend, SIZES, cache=cache, **options))
        mode = "exact" if exact else "fast"
        print(f"\n{mode} kernels, {threads} threads, {trials} calibrations per order (ms; x one-row pass)")
        for order, runs in curves.items():
            for curve in runs:
                one = curve[1]
                print(f"  {order:13s} " + " ".join(f"{s}:{curve[s] * 1e3:6.1f}/{curve[s] / one:5.2f}" for s in SIZES))
            for s in (2, 3, 5, 33):
                shape = [c[s] / c[1] for c in runs]
                print(f"  {order:13s} cost({s})/cost(1): min {min(shape):.2f} max {max(shape):.2f} "
                      f"spread {max(shape) / min(shape) - 1:.0%}")
        del backend


if __name__ == "__main__":
    main()
