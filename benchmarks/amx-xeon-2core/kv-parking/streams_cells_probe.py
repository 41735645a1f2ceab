"""Probe: one-row decode passes of 4 sequences, unified KV vs one stream per sequence, by cells per sequence."""
import os, sys, time, random
sys.path.insert(0, "/work/main/src")
import specdec.backends.llamacpp_backend as lb
KVU = os.environ.get("KVU", "1") == "1"
_init = lb.LlamaCppBackend.__init__
def init(self, *a, **kw):
    kw["kv_unified"] = KVU
    return _init(self, *a, **kw)
lb.LlamaCppBackend.__init__ = init
from specdec.config import ModelRef
from specdec.pipeline import SpecDecoder
from specdec.backends.base import BatchRows
dec = SpecDecoder.load(ModelRef(draft=None, threads=2, parallel=4, max_context=2048))
b = dec.target
rng = random.Random(0)
tok = lambda n: [rng.randrange(1000, 20000) for _ in range(n)]
for cells in (100, 800):
    caches = [b.new_cache() for _ in range(4)]
    for c in caches:
        b.forward_batch([BatchRows(tok(cells), c, 1)])
    for rep in range(2):
        for n in (1, 4):
            steps = 12
            t = time.perf_counter()
            for _ in range(steps):
                b.forward_batch([BatchRows(tok(n), c, n) for c in caches])
                for c in caches: c.trim(n - 1)
            print(f"KVU={int(KVU)} ~{cells} cells/seq, 4 seqs x {n} rows: {(time.perf_counter()-t)/steps:.3f} s/pass", flush=True)
    for c in caches: c.trim(c.length)
    del caches, c
    import gc; gc.collect()
