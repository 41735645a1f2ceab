"""In-engine check of time to first token under load (no server, no HTTP): the serving bench's 30 prompts (two
first-turn questions per Spec-Bench category, two HumanEval, two code_edit) sent by C clients in a closed loop
through one BatchEngine, greedy, default pair, 2 threads, chat template.

    python benchmarks/serve-2core/ttft_profile.py CONCURRENCY [MAX_TOKENS] [DRAFTER]   # e.g. 4 128 suffix

A request arrives when the client's previous one ends (all C at once at the start) and is admitted at the next step
boundary; its TTFT runs from its arrival to the step that gives its first token. Prints aggregate tok/s (prefill
included), TTFT p50 / p90 / mean, end-to-end p50 / p90, and the decode-only shared passes by row count (count,
median ms, ms per row). Run one at a time on a quiet machine.
"""

import statistics
import sys
import time

from specdec.bench.datasets import select_prompts
from specdec.config import ModelRef, SamplingParams, SpecConfig
from specdec.pipeline import SpecDecoder


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


concurrency = int(sys.argv[1])
max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
drafter = sys.argv[3] if len(sys.argv) > 3 else "suffix"
ref = ModelRef(target="default-target", draft=None, parallel=concurrency, threads=2, max_context=2048)
spec = SpecConfig(drafter=drafter, k_policy="adaptive") if drafter != "none" else SpecConfig(drafter="none")
decoder = SpecDecoder.load(ref, spec)
prompts = [decoder.encode(p.text) for p in select_prompts("spec_bench,humaneval,code_edit", None, 2)]  # chat template
params = SamplingParams(max_tokens=max_tokens)
batch = decoder.engine().batch
batch.set_max_running(concurrency)
waiting = list(enumerate(prompts))
arrivals = {}  # prompt index -> arrival time
firsts, ends = {}, {}
began = time.perf_counter()
ready = concurrency  # clients whose next request has arrived
queue = []
tokens = steps = rows = 0
target = decoder.target
decode_passes = {}  # rows -> seconds of every decode-only pass of several sequences with that many rows
record = batch._record_shared_pass


def record_and_keep(rows_in_pass, seconds, *args):
    decode_passes.setdefault(rows_in_pass, []).append(seconds)
    record(rows_in_pass, seconds, *args)


batch._record_shared_pass = record_and_keep
forward_before = target.forward_seconds
while waiting or queue or batch.running:
    now = time.perf_counter()
    while ready and waiting:
        index, prompt = waiting.pop(0)
        arrivals[index] = now
        queue.append((index, prompt))
        ready -= 1
    while queue and batch.has_room:
        index, prompt = queue.pop(0)
        batch.add(prompt, params, tag=index)
    outputs = batch.step()
    steps += 1
    rows += batch.last_pass_rows
    now = time.perf_counter()
    for output in outputs:
        index = output.sequence.tag
        tokens += len(output.tokens)
        if output.tokens and index not in firsts:
            firsts[index] = now
        if output.finish_reason is not None:
            ends[index] = now
            ready += 1
wall = time.perf_counter() - began
ttft = [firsts[i] - arrivals[i] for i in arrivals]
e2e = [ends[i] - arrivals[i] for i in arrivals]
print(f"C={concurrency} drafter {drafter} max_tokens {max_tokens}: {len(arrivals)} requests, {tokens} tokens, "
      f"wall {wall:.1f} s, {tokens / wall:.2f} tok/s; TTFT p50 {percentile(ttft, 0.5):.2f} p90 "
      f"{percentile(ttft, 0.9):.2f} mean {statistics.mean(ttft):.2f} s; e2e p50 {percentile(e2e, 0.5):.1f} "
      f"p90 {percentile(e2e, 0.9):.1f} s")
print(f"steps {steps}, rows {rows}, in target passes {target.forward_seconds - forward_before:.1f} s, "
      f"drafted {batch.total_stats.num_draft_tokens}, accepted {batch.total_stats.num_accepted_tokens}")
print("decode-only shared passes (rows: count, median ms, ms per row): " + "; ".join(
    f"{n}: {len(v)}, {1000 * statistics.median(v):.0f}, {1000 * statistics.median(v) / n:.1f}"
    for n, v in sorted(decode_passes.items())))
