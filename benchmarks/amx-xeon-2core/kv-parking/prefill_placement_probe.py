"""Probe: cost of a 512-row prompt chunk in llama.cpp's unified KV, alone vs beside decode rows (1 or 2 calls)."""
import json, os, sys, time, random
sys.path.insert(0, os.environ.get("SRC", "/work/main/src"))
from specdec.config import ModelRef
from specdec.pipeline import SpecDecoder
from specdec.backends.base import BatchRows
import llama_cpp
if os.environ.get("FA") == "0":
    _init = llama_cpp.llama_init_from_model
    def init(model, params):
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        return _init(model, params)
    llama_cpp.llama_init_from_model = init
dec = SpecDecoder.load(ModelRef(draft=None, threads=2, parallel=4))
b = dec.target
rows = [json.loads(l) for l in open("/work/shared/data/spec_bench_dev.jsonl")]
long_text = [r for r in rows if r["category"] == "rag"][4]["turns"][0]
prompt = dec.encode(long_text)[:700]
rng = random.Random(0)
def others(n_cells, park=False):
    """Three streams decoded together step by step (interleaved cells), then one freed (holes)."""
    caches = [b.new_cache() for _ in range(4)]
    for c in caches:
        b.forward_batch([BatchRows([rng.randrange(1000, 20000) for _ in range(24)], c, 1)])
    for _ in range(n_cells):
        b.forward_batch([BatchRows([rng.randrange(1000, 20000) for _ in range(4)], c, 1) for c in caches])
    if park:
        global parked
        parked = caches[0]  # the finished stream's cells stay taken until the new prompt is in
        return caches[1:]
    caches[0].trim(caches[0].length)  # a finished stream's cells become holes among the others'
    return caches[1:]
def run(label, decode_rows, fit_one_call, n_cells=60, park=False):
    global parked
    parked = None
    live = others(n_cells, park) if decode_rows is not None else []
    cache = b.new_cache()
    chunk = 512 - (3 * decode_rows if (fit_one_call and decode_rows) else 0)
    t = time.perf_counter()
    entries = [BatchRows(prompt[:chunk], cache, 0)]
    if decode_rows:
        entries += [BatchRows([rng.randrange(1000, 20000) for _ in range(decode_rows)], c, decode_rows) for c in live]
    b.forward_batch(entries)
    dt = time.perf_counter() - t
    print(f"{label:55s} prompt rows {chunk:4d} + decode rows {3*(decode_rows or 0):2d}: {dt:.3f} s  calls {b.last_pass_decodes}", flush=True)
    if parked is not None:
        parked.trim(parked.length)
    for c in live + [cache]:
        c.trim(c.length)
    return dt
b.forward_batch([BatchRows(prompt[:64], b.new_cache(), 1)])  # warm
def decode_steps(n_cells=200, steps=10):
    live = others(n_cells)
    t = time.perf_counter()
    for _ in range(steps):
        b.forward_batch([BatchRows([rng.randrange(1000, 20000) for _ in range(4)], c, 4) for c in live])
    dt = (time.perf_counter() - t) / steps
    print(f"decode step, 3 streams x 4 rows, ~{24 + 4 * n_cells} cells each: {dt:.3f} s", flush=True)
    for c in live: c.trim(c.length)
print("FA", os.environ.get("FA", "auto"))
for rep in range(2):
    run("after 3 interleaved streams, holes parked, prompt alone", 0, False, park=True)
    run("+ 3 streams x 4 rows, holes parked, split calls", 4, False, park=True)
    run("fresh context, prompt alone", None, False)
    run("after 3 interleaved streams, prompt alone", 0, False)
    run("+ 3 streams x 4 rows, split calls (today)", 4, False)
    run("+ 3 streams x 4 rows, chunk shortened: one call", 4, True)
