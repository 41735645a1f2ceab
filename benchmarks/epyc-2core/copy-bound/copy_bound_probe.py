"""Copy bound on more prompts than the method bench: plain greedy outputs (default target, default kernels, 128 new
tokens) of the first N prompts of each category, then copy_bound.copy_bound on the engine's calibrated curve at k <= 32,
the prompts in the order given (earlier outputs as the cross-request cache), spans chained through 12 shared tokens
as the suffix drafter chains them. No timing is compared: the bound is a
function of the texts and the curve. Usage: PYTHONPATH=src python copy_bound_probe.py summarization,code_edit 20 [threads]"""
import json, sys
from specdec import load
from specdec.bench.datasets import select_prompts, spec_bench_path
from specdec.calibration import machine_ceiling
from specdec.config import SamplingParams, SpecConfig
from specdec.copy_bound import combined_speedup, copy_bound
from specdec.kvcache import release_retained

categories, per = sys.argv[1].split(","), int(sys.argv[2])
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
decoder = load("default", draft=None, threads=threads)
plain = decoder.engine(SpecConfig(drafter="none"))
params = SamplingParams(temperature=0.0, max_tokens=128)
# The curve the defaults read: a suffix engine calibrates (or reads this machine's cached curve) on first use.
decoder.engine(SpecConfig(drafter="suffix", k_policy="adaptive", num_speculative_tokens=32)).generate(
    decoder.encode("Hello", chat=True), SamplingParams(temperature=0.0, max_tokens=4))
curve = {int(k): v for k, v in decoder.target.pass_costs.items()}
rows = [json.loads(line) for line in open(spec_bench_path())]
prompts = []
for category in categories:
    if category in ("code_edit", "humaneval"):
        prompts += [(category, p.id, p.text) for p in select_prompts(category, None, per, 1)]
    else:
        prompts += [(category, r["question_id"], r["turns"][0]) for r in rows if r["category"] == category][:per]
history, bounds, records = [], {}, []
for category, pid, text in prompts:
    ids = decoder.encode(text, chat=True)
    release_retained(decoder.target)
    tokens = list(plain.generate(ids, params).tokens)
    bound = copy_bound(ids, tokens, curve, 32, history, chain_overlap=12)  # the suffix drafter's chaining (depth 24 / 2)
    bounds.setdefault(category, []).append(bound)
    records.append({"category": category, "id": pid, "prompt_tokens": len(ids), **bound, "prompt_ids": ids,
                    "tokens": tokens})
    history = (history + [tokens])[-64:]
    while sum(map(len, history)) > 8192:
        history.pop(0)
    print(category, pid, len(ids), len(tokens), f"{bound['speedup']:.2f}x", flush=True)
ceiling, k = machine_ceiling(curve, 32)
summary = {"curve_ms": {n: round(1000 * s, 2) for n, s in sorted(curve.items())}, "ceiling": ceiling, "ceiling_k": k,
           "per_category": {c: {"prompts": len(b), "copy_bound": combined_speedup(b),
                                "share_of_ceiling": combined_speedup(b) / ceiling} for c, b in bounds.items()}}
json.dump({"summary": summary, "prompts": records}, open(sys.argv[4] if len(sys.argv) > 4 else "copy_bound.json", "w"), indent=1)
print(json.dumps(summary, indent=1))
