"""Probe: prefill a prompt chunk in a side context of its own (fresh cells) and copy its KV into the main unified
buffer (llama_state_seq_get/set_data), vs prefilling it in the main buffer among 3 interleaved streams' cells."""
import ctypes, json, os, sys, time, random
sys.path.insert(0, "/work/main/src")
from specdec.config import ModelRef
from specdec.pipeline import SpecDecoder
from specdec.backends.base import BatchRows
import llama_cpp as L
dec = SpecDecoder.load(ModelRef(draft=None, threads=2, parallel=4))
b = dec.target
p = L.llama_context_default_params()
p.n_ctx = 2048; p.n_batch = 512; p.n_ubatch = 512; p.n_seq_max = 1; p.kv_unified = True
p.n_threads = 2; p.n_threads_batch = 2; p.no_perf = True
side = L.llama_init_from_model(b._model, p)
side_mem = L.llama_get_memory(side)
rows = [json.loads(l) for l in open("/work/shared/data/spec_bench_dev.jsonl")]
prompt = dec.encode([r for r in rows if r["category"] == "rag"][4]["turns"][0])[:700]
rng = random.Random(0)
tok = lambda n: [rng.randrange(1000, 20000) for _ in range(n)]
def others(n_cells=60):
    caches = [b.new_cache() for _ in range(4)]
    for c in caches:
        b.forward_batch([BatchRows(tok(24), c, 1)])
    for _ in range(n_cells):
        b.forward_batch([BatchRows(tok(4), c, 1) for c in caches])
    caches[0].trim(caches[0].length)
    return caches[1:]
def side_decode(tokens, pos0, want_last):
    batch = L.llama_batch_init(len(tokens), 0, 1)
    for i, t in enumerate(tokens):
        batch.token[i] = t; batch.pos[i] = pos0 + i; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = 0
        batch.logits[i] = 1 if (want_last and i == len(tokens) - 1) else 0
    batch.n_tokens = len(tokens)
    assert L.llama_decode(side, batch) == 0
    L.llama_batch_free(batch)
def copy(src_ctx, src_seq, dst_ctx, dst_seq):
    n = L.llama_state_seq_get_size(src_ctx, src_seq)
    buf = (ctypes.c_uint8 * n)()
    assert L.llama_state_seq_get_data(src_ctx, buf, n, src_seq) == n
    assert L.llama_state_seq_set_data(dst_ctx, buf, n, dst_seq) == n
    return n
b.forward_batch([BatchRows(prompt[:64], b.new_cache(), 1)])
side_decode(prompt[:64], 0, True); L.llama_memory_seq_rm(side_mem, 0, -1, -1)
for rep in range(2):
    live = others()
    cache = b.new_cache()
    t = time.perf_counter()
    b.forward_batch([BatchRows(prompt[:512], cache, 0)])
    b.forward_batch([BatchRows(prompt[512:], cache, 1)])
    main_s = time.perf_counter() - t
    ref = b.forward_batch([BatchRows([prompt[-1]], cache, 1)])[0]  # one more row: next-token logits (sanity)
    cache.trim(cache.length)
    for c in live: c.trim(c.length)
    del live, cache
    live = others()
    cache = b.new_cache()
    t = time.perf_counter()
    side_decode(prompt[:512], 0, False)
    t1 = time.perf_counter()
    side_decode(prompt[512:], 512, True)
    t2 = time.perf_counter()
    n = copy(side, 0, b._ctx, cache.seq_id)
    L.llama_memory_seq_rm(side_mem, 0, -1, -1)
    t3 = time.perf_counter()
    cache.length = 700
    got = b.forward_batch([BatchRows([prompt[-1]], cache, 1)])[0]
    print(f"main buffer among 3 streams: {main_s:.3f} s | side context: chunk1 {t1-t:.3f} chunk2 {t2-t1:.3f} copy {t3-t2:.3f} s ({n/1e6:.1f} MB) total {t3-t:.3f} s | next-token argmax {int(ref.argmax())} vs {int(got.argmax())}, max|diff| {float((ref-got).abs().max()):.3g}", flush=True)
    cache.trim(cache.length)
    for c in live: c.trim(c.length)
    del live, cache
    import gc; gc.collect()
