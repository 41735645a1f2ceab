"""In-engine check of continuous batching (no server, no HTTP): the first 12 of the serving bench's prompts through
one BatchEngine with up to `parallel` sequences per pass, greedy, 96 new tokens, default pair, 2 threads.

    python benchmarks/serve-2core/batch_profile.py PARALLEL DRAFTER     # e.g. 4 suffix, 4 none, 1 none

Prints wall time, time inside target passes, steps, rows, tokens, tok/s (prefill included) and drafted/accepted
tokens. Run one at a time on a quiet machine.
"""

import sys
import time

from specdec.bench.datasets import select_prompts
from specdec.config import ModelRef, SamplingParams, SpecConfig
from specdec.pipeline import SpecDecoder

parallel, drafter = int(sys.argv[1]), sys.argv[2]
ref = ModelRef(target="default-target", draft=None, parallel=parallel, threads=2, max_context=2048)
spec = SpecConfig(drafter=drafter, k_policy="adaptive") if drafter != "none" else SpecConfig(drafter="none")
decoder = SpecDecoder.load(ref, spec)
prompts = [decoder.encode(p.text) for p in select_prompts("spec_bench,humaneval,code_edit", None, 1)][:12]
params = SamplingParams(max_tokens=96)
batch = decoder.engine().batch
batch.set_max_running(parallel)
target = decoder.target
waiting = list(prompts)
began, forward_before = time.perf_counter(), target.forward_seconds
steps = rows = tokens = 0
while waiting or batch.running:
    while waiting and batch.has_room:
        batch.add(waiting.pop(0), params)
    outputs = batch.step()
    steps += 1
    rows += batch.last_pass_rows
    tokens += sum(len(o.tokens) for o in outputs)
wall = time.perf_counter() - began
print(f"parallel {parallel}, drafter {drafter}: wall {wall:.1f} s, in target passes {target.forward_seconds - forward_before:.1f} s, "
      f"steps {steps}, rows {rows}, tokens {tokens}, {tokens / wall:.1f} tok/s")
print(f"drafted {batch.total_stats.num_draft_tokens}, accepted {batch.total_stats.num_accepted_tokens}")
