"""One process: load the default target (fast mode, 2 threads) with its file mapped or read into memory; RSS and
one-row decode ms. Usage: GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python mmap_ab.py mmap|read"""
import os, sys, time, statistics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "src"))
use_mmap = sys.argv[1] == "mmap"
import specdec.backends.llamacpp_backend as llamacpp_backend
from specdec.backends.llamacpp_backend import LlamaCppBackend

if use_mmap:  # the backend reads repacked weights into memory since 2026-12-05; this arm maps the file as before
    llamacpp_backend._read_weights_into_memory = lambda model_params: None
from specdec.models import cache_dir
import torch
def rss():
    d = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "RssAnon", "RssFile", "VmHWM")):
            k, v = line.split(":"); d[k] = int(v.split()[0]) // 1024
    return d
t = time.perf_counter()
b = LlamaCppBackend(cache_dir() / "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", max_context=2048, threads=2, batch_invariant=False)
load = time.perf_counter() - t
cache = b.new_cache() if hasattr(b, "new_cache") else None
print("describe", b.runtime_summary(), "mmap param", use_mmap)
prompt = [int(x) for x in torch.randint(100, 20000, (300,), generator=torch.Generator().manual_seed(0))]
logits = b.forward(prompt, cache) if cache is not None else None
tok = int(logits[-1].argmax())
times = []
for i in range(64):
    t = time.perf_counter(); logits = b.forward([tok], cache); times.append(time.perf_counter() - t); tok = int(logits[-1].argmax())
print("RESULT", "mmap" if use_mmap else "nommap", f"load {load:.1f}s", f"median {1000*statistics.median(times):.1f} ms", rss(), flush=True)
import re
cur=None; agg={}
for line in open("/proc/self/smaps"):
    if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
        parts=line.split(); cur=parts[5] if len(parts)>5 else "[anon]"
    elif line.startswith("Rss:"):
        agg[cur]=agg.get(cur,0)+int(line.split()[1])
print("TOP", sorted(((v//1024,k) for k,v in agg.items()), reverse=True)[:8])
cur=None
for line in open("/proc/self/smaps"):
    if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
        parts=line.split(); cur=(parts[0], parts[1], parts[5] if len(parts)>5 else "")
    elif line.startswith("Rss:") and "gguf" in cur[2]:
        a,b=cur[0].split("-"); print("GGUFMAP", cur[1], (int(b,16)-int(a,16))//2**20, "MiB mapped", int(line.split()[1])//1024, "MiB rss")
