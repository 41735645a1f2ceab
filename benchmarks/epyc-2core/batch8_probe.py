"""Probe: on this CPU, does one decode pass of 8 sequences x 1 row cost less than 8 one-row passes? Unified KV (the
fast mode's layout with several slots), default target, 2 threads, by cells per sequence.

    PYTHONPATH=src python benchmarks/epyc-2core/batch8_probe.py
"""
import random
import time

from specdec.backends.base import BatchRows
from specdec.config import ModelRef
from specdec.pipeline import SpecDecoder

SEQUENCES, STEPS = 8, 6
decoder = SpecDecoder.load(ModelRef(draft=None, threads=2, parallel=SEQUENCES, max_context=2048))
target = decoder.target
rng = random.Random(0)


def tokens(n):
    return [rng.randrange(1000, 20000) for _ in range(n)]


for cells in (100, 600):
    caches = [target.new_cache() for _ in range(SEQUENCES)]
    for cache in caches:
        target.forward_batch([BatchRows(tokens(cells), cache, 1)])
    for repeat in range(2):
        began = time.perf_counter()
        for _ in range(STEPS):
            target.forward_batch([BatchRows(tokens(1), cache, 1) for cache in caches])
        shared = (time.perf_counter() - began) / STEPS
        began = time.perf_counter()
        for _ in range(STEPS):
            target.forward_batch([BatchRows(tokens(1), caches[0], 1)])
        alone = (time.perf_counter() - began) / STEPS
        print(f"~{cells} cells/seq: {SEQUENCES} seqs x 1 row {shared * 1e3:.1f} ms/pass = {shared / SEQUENCES * 1e3:.1f} "
              f"ms/token; 1 seq x 1 row {alone * 1e3:.1f} ms/token; shared/alone per token "
              f"{shared / SEQUENCES / alone:.2f}", flush=True)
    for cache in caches:
        cache.trim(cache.length)
