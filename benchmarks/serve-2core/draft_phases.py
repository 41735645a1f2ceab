"""Where drafting pays at 8 sequences: steps, drafted and accepted tokens, rows and target seconds, grouped by how
many sequences decoded in the step and whether a prefill chunk shared the pass. The same 12 prompts, 96 tokens,
default pair, 2 threads as batch_profile.py. Run one at a time on a quiet machine:

    python benchmarks/serve-2core/draft_phases.py suffix     # the default drafter
    python benchmarks/serve-2core/draft_phases.py none       # plain decoding, the same batching
"""
import sys, time, collections
from specdec.bench.datasets import select_prompts
from specdec.config import ModelRef, SamplingParams, SpecConfig
from specdec.pipeline import SpecDecoder
ref = ModelRef(target="default-target", draft=None, parallel=8, threads=2, max_context=2048)
decoder = SpecDecoder.load(ref, SpecConfig(drafter=sys.argv[1]) if sys.argv[1] == "none" else SpecConfig(drafter=sys.argv[1], k_policy="adaptive"))
prompts = [decoder.encode(p.text) for p in select_prompts("spec_bench,humaneval,code_edit", None, 1)][:12]
params = SamplingParams(max_tokens=96)
batch = decoder.engine().batch
batch.set_max_running(8)
waiting = list(prompts)
by = collections.defaultdict(lambda: [0, 0, 0, 0.0, 0])  # steps, drafted, accepted, seconds, rows
target = decoder.target
while waiting or batch.running:
    while waiting and batch.has_room:
        batch.add(waiting.pop(0), params)
    deciders = sum(1 for s in batch.running if not s.prefilling)
    prefilling = any(s.prefilling for s in batch.running)
    before = {id(s): (s.stats.num_draft_tokens, s.stats.num_accepted_tokens) for s in batch.running}
    seqs = list(batch.running)
    t0 = target.forward_seconds
    batch.step()
    key = (deciders, prefilling)
    e = by[key]
    e[0] += 1
    for s in seqs:
        d0, a0 = before[id(s)]
        e[1] += s.stats.num_draft_tokens - d0
        e[2] += s.stats.num_accepted_tokens - a0
    e[3] += target.forward_seconds - t0
    e[4] += batch.last_pass_rows
for key in sorted(by):
    st, dr, ac, sec, rows = by[key]
    print(f"deciders {key[0]} prefill {key[1]!s:5}: steps {st:4d} drafted {dr:4d} accepted {ac:4d} rows {rows:5d} seconds {sec:6.2f}")
