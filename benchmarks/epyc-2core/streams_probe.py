"""Probe: 8 sequences decoding together in fast mode, one unified KV buffer vs one KV stream per sequence; the
default target, 2 threads, rounds alternating the two layouts (both loaded at once)."""
import random, statistics, time
from specdec.backends import llamacpp_backend as lb
from specdec.backends.base import BatchRows
from specdec.models import load_backend

MODE = {"unified": None}
_orig = lb.LlamaCppBackend.__init__
def _patched(self, *a, kv_unified=None, **kw):
    _orig(self, *a, kv_unified=MODE["unified"], **kw)
lb.LlamaCppBackend.__init__ = _patched

SEQ, STEPS, ROUNDS = 8, 4, 3
targets = {}
for unified in (True, False):
    MODE["unified"] = unified
    targets[unified] = load_backend("default-target", role="target", threads=2, parallel=SEQ, max_context=2048)
    print("loaded unified" if unified else "loaded streams", targets[unified].kv_unified, flush=True)
rng = random.Random(0)
tok = lambda n: [rng.randrange(1000, 20000) for _ in range(n)]
MIXED = [1, 4, 1, 2, 1, 3, 1, 5]
caches = {u: [t.new_cache() for _ in range(SEQ)] for u, t in targets.items()}
for cells, add in ((100, 100), (600, 500)):
    for u, t in targets.items():
        for c in caches[u]:
            t.forward_batch([BatchRows(tok(add), c, 1)])
    res = {}
    for r in range(ROUNDS):
        for u in ((True, False) if r % 2 == 0 else (False, True)):
            t, cs = targets[u], caches[u]
            for name, rows in (("8x1", [1] * SEQ), ("mixed18", MIXED), ("1x1", [1])):
                began = time.perf_counter()
                for _ in range(STEPS):
                    t.forward_batch([BatchRows(tok(n), c, n) for n, c in zip(rows, cs)])
                    decodes = t.last_pass_decodes
                    for n, c in zip(rows, cs):
                        c.trim(n)
                res.setdefault((u, name), []).append((time.perf_counter() - began) / STEPS * 1e3)
                res.setdefault((u, name, "decodes"), []).append(decodes)
    for name in ("8x1", "mixed18", "1x1"):
        for u in (True, False):
            ms = res[(u, name)]
            print(f"~{cells} cells/seq {name:8s} {'unified' if u else 'streams'}: ms/pass median {statistics.median(ms):.1f} "
                  f"(runs {', '.join(f'{m:.1f}' for m in ms)}), llama_decode calls {res[(u, name, 'decodes')][-1]}", flush=True)
