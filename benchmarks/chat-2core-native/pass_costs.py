"""Pass cost per row count of the default target, fast vs --exact kernels, and which rows differ from one-row passes (run: python benchmarks/chat-2core-native/pass_costs.py THREADS)."""
import statistics, sys, time, torch
from specdec.backends.llamacpp_backend import LlamaCppBackend
from specdec.models import cache_dir
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
path = cache_dir() / "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"
prefix = [(i * 37 + 11) % 30000 for i in range(200)]
rows = [(i * 53 + 7) % 30000 for i in range(9)]
for exact in (False, True):
    b = LlamaCppBackend(path, max_context=1024, threads=threads, batch_invariant=exact)
    print(b.runtime_summary(), flush=True)
    c = b.new_cache(); b.forward(prefix, c)
    alone = [b.forward([t], c)[0] for t in rows]
    out = {}
    for n in (1, 2, 3, 4, 6, 8):
        ts = []
        for _ in range(5):
            c.trim(c.length - len(prefix))
            t0 = time.perf_counter(); got = b.forward(rows[:n], c, num_logits=n); ts.append(time.perf_counter() - t0)
        diff = sum(not torch.equal(got[i], alone[i]) for i in range(n))
        out[n] = (round(statistics.median(ts) * 1000, 1), diff)
    print("exact" if exact else "fast", "ms (rows differing from one-row passes) per n:", out, flush=True)
    b.close()
