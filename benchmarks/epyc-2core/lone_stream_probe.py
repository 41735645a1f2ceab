"""Probe: after a burst, one request decodes while the other three slots keep their last requests' cells (prefix
reuse) in the unified KV buffer of a 4-slot server (the `specdec serve` default on llama.cpp): ms per one-row step
with those cells kept vs freed. Fast mode, the default target, 2 threads, rounds alternating the two.

    PYTHONPATH=src python benchmarks/epyc-2core/lone_stream_probe.py
"""
import random
import statistics
import time

from specdec.backends.base import BatchRows
from specdec.models import load_backend

SLOTS, CELLS, STEPS, ROUNDS = 4, 700, 8, 4
target = load_backend("default-target", role="target", threads=2, parallel=SLOTS, max_context=2048)
rng = random.Random(0)


def tokens(n):
    return [rng.randrange(1000, 20000) for _ in range(n)]


def one_row_ms(cache):
    began = time.perf_counter()
    for _ in range(STEPS):
        target.forward_batch([BatchRows(tokens(1), cache, 1)])
    cache.trim(STEPS)
    return (time.perf_counter() - began) / STEPS * 1e3


lone = target.new_cache()
target.forward_batch([BatchRows(tokens(CELLS), lone, 1)])
others = [target.new_cache() for _ in range(SLOTS - 1)]
results = {"kept": [], "freed": []}
for round_ in range(ROUNDS):
    for state in (("kept", "freed") if round_ % 2 == 0 else ("freed", "kept")):
        for cache in others:
            if state == "kept" and cache.length == 0:
                target.forward_batch([BatchRows(tokens(CELLS), cache, 1)])
            if state == "freed" and cache.length:
                cache.trim(cache.length)
        results[state].append(one_row_ms(lone))
for state, ms in results.items():
    print(f"lone request at ~{CELLS} cells, other {SLOTS - 1} slots' ~{CELLS} cells {state}: median "
          f"{statistics.median(ms):.1f} ms per one-row step (rounds {', '.join(f'{m:.1f}' for m in ms)})", flush=True)
