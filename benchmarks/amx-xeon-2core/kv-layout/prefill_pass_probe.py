"""Probe: rows per pass when a long prompt arrives beside running streams (BatchEngine, default suffix drafter)."""
import json, sys, time, os
sys.path.insert(0, os.environ.get("SRC", "/work/main/src"))
from specdec.config import ModelRef, SpecConfig, SamplingParams, adaptive_max_k
from specdec.pipeline import SpecDecoder
from specdec.scheduler import BatchEngine
if os.environ.get("KVU") == "0":
    import specdec.backends.llamacpp_backend as lb, inspect
    orig = lb.LlamaCppBackend.__init__
    def init(self, *a, **kw):
        kw["kv_unified"] = False
        return orig(self, *a, **kw)
    lb.LlamaCppBackend.__init__ = init
from specdec.bench.datasets import load_tasks
C = int(sys.argv[1]) if len(sys.argv) > 1 else 4
rows = [json.loads(l) for l in open("/work/shared/data/spec_bench_dev.jsonl")]
by = {}
for r in rows: by.setdefault(r["category"], []).append(r)
dec = SpecDecoder.load(ModelRef(draft=None, threads=2, parallel=C))
eng = dec.engine(dec.spec)
batch = eng.batch; batch.set_max_running(C)
chat = lambda t: dec.encode(t)
streams = [p.text for p in load_tasks(["humaneval"], 2)] + [by["writing"][3]["turns"][0], by["stem"][3]["turns"][0]]
params = SamplingParams(max_tokens=128, temperature=0.0)
# warm up + calibration
batch.add(chat("Hello"), SamplingParams(max_tokens=4, temperature=0.0))
while batch.running: batch.step()
for text in streams[:C - 1]:
    batch.add(chat(text), params)
t=time.perf_counter(); n=0
for _ in range(12): batch.step(); n+=1
print("decode: 12 steps %.3f s" % (time.perf_counter()-t), "target", dec.target.describe().get("kv_unified") if hasattr(dec.target,"describe") else None)
A, B = (4, 5) if os.environ.get("SWAP") is None else (5, 4)
long_prompt = chat(by["rag"][A]["turns"][0])
seq = batch.add(long_prompt, params)
t0 = time.perf_counter()
log = []
while seq.prefilling:
    t = time.perf_counter(); batch.step(); dt = time.perf_counter() - t
    log.append((batch.last_pass_rows, round(dt, 3)))
ttft = time.perf_counter() - t0
print("C", C, "prompt", len(long_prompt), "passes (rows, s):", log, "prefill wall %.2f s" % ttft)

while batch.running: batch.step()
alone = chat(by["rag"][B]["turns"][0])
seq = batch.add(alone, params); t0 = time.perf_counter(); log = []
while seq.prefilling:
    t = time.perf_counter(); batch.step(); dt = time.perf_counter() - t
    log.append((batch.last_pass_rows, round(dt, 3)))
print("alone prompt", len(alone), "passes", log, "prefill wall %.2f s" % (time.perf_counter() - t0))
