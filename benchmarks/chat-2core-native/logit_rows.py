"""What a verification's logits cost: ms per target pass of n rows with logits for every row (`all`, through
forward), the same without our copy of the logits (`rawall`, llama_decode alone) and with the last row's logits
only (`last`, what llama-bench's prompt test and a prefill compute). Fast mode, 2 threads, default target, after
a 300-token prefix, median of 5 after one warm-up round.

    python benchmarks/chat-2core-native/logit_rows.py
"""
import time, statistics, sys
import numpy as np
from specdec.backends.llamacpp_backend import LlamaCppBackend
from specdec.backends.base import BatchRows
from specdec.models import cache_dir

b = LlamaCppBackend(cache_dir() / "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", max_context=2048, threads=2, batch_invariant=False)
cache = b.new_cache(2048)
prompt = list(range(1000, 1300))
b.forward(prompt, cache, 1)
base = cache.length
res = {}
for rep in range(6):
    for n in (1, 2, 4, 6, 8):
        for mode in ("all", "last", "rawall"):
            toks = list(range(2000, 2000 + n))
            t = time.perf_counter()
            if mode == "rawall":
                b._decode_rows([(tok, base + i, cache.seq_id, True) for i, tok in enumerate(toks)])
                cache.length = base + n
            else:
                b.forward(toks, cache, n if mode == "all" else 1)
            dt = time.perf_counter() - t
            cache.trim(cache.length - base)
            if rep: res.setdefault((n, mode), []).append(dt * 1000)
for n in (1, 2, 4, 6, 8):
    print(n, " ".join(f"{m} {statistics.median(res[(n, m)]):.1f}" for m in ("all", "rawall", "last")))
