"""Probe: decode passes of 3 sequences in one unified KV buffer vs one KV stream per sequence (kv_unified off),
with equal and unequal rows per sequence, and a 512-row prompt chunk beside them."""
import json, os, sys, time, random
sys.path.insert(0, os.environ.get("SRC", "/work/main/src"))
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
dec = SpecDecoder.load(ModelRef(draft=None, threads=2, parallel=4))
b = dec.target
rng = random.Random(0)
rows = [json.loads(l) for l in open("/work/shared/data/spec_bench_dev.jsonl")]
prompt = dec.encode([r for r in rows if r["category"] == "rag"][4]["turns"][0])[:700]
tok = lambda n: [rng.randrange(1000, 20000) for _ in range(n)]
caches = [b.new_cache() for _ in range(3)]
for c in caches:
    b.forward_batch([BatchRows(tok(24), c, 1)])
for _ in range(60):
    b.forward_batch([BatchRows(tok(4), c, 4) for c in caches])
    for c in caches: c.trim(2)
def timed(label, counts, steps=8):
    t = time.perf_counter()
    for _ in range(steps):
        b.forward_batch([BatchRows(tok(n), c, n) for n, c in zip(counts, caches)])
        for n, c in zip(counts, caches): c.trim(n - 1)
    print(f"KVU={int(KVU)} {label:28s} rows {counts}: {(time.perf_counter() - t) / steps:.3f} s/pass, calls {b.last_pass_decodes}", flush=True)
for rep in range(2):
    timed("one row each", [1, 1, 1])
    timed("unequal", [7, 3, 1])
    timed("padded to equal", [7, 7, 7])
    timed("equal 4", [4, 4, 4])
    new = b.new_cache()
    t = time.perf_counter()
    b.forward_batch([BatchRows(prompt[:500], new, 0)] + [BatchRows(tok(4), c, 4) for c in caches])
    print(f"KVU={int(KVU)} 500 prompt rows + 3 x 4 rows: {time.perf_counter() - t:.3f} s, calls {b.last_pass_decodes}", flush=True)
    for c in caches: c.trim(3)
    new.trim(new.length); del new
