"""In-engine: drafting steps of the default suffix drafter under several decision margins (variants "M" or "M@CARRY",
CARRY = acceptance evidence kept per new request), priced on the engine's own passes."""
import json, sys, time, collections, os
sys.path.insert(0, "/work/main/src")
from specdec.config import ModelRef, SpecConfig, SamplingParams, adaptive_max_k
from specdec.pipeline import SpecDecoder
from specdec.kvcache import release_retained
from specdec.scheduler import BatchEngine
import specdec.adaptive as ad
from specdec.bench.datasets import load_tasks

cats = sys.argv[1].split(","); first, per = map(int, sys.argv[2].split(":")); margins = sys.argv[3].split(",")
threads = int(os.environ.get("THREADS", "2"))
rows = [json.loads(l) for l in open("/work/shared/data/spec_bench_dev.jsonl")]
prompts = []
for c in cats:
    if c in ("code_edit", "humaneval"):
        prompts += [{"category": c, "turns": [p.text]} for p in load_tasks([c], first + per)[first:]]
    else:
        prompts += [r for r in rows if r["category"] == c][first:first + per]
dec = SpecDecoder.load(ModelRef(draft=None, threads=threads))
params = SamplingParams(max_tokens=128, temperature=0.0)
K = adaptive_max_k("suffix", False)
specs = {m: SpecConfig(drafter="suffix", k_policy="adaptive", num_speculative_tokens=K, suffix_cache_tokens=8192 + i)
         for i, m in enumerate(margins)}
current = {"margin": "0", "variant": None, "cat": None}
orig_best = ad.AdaptiveK.best_k
def best_k(self):
    if self.learns_from_plans:
        margin, _, carry = current["margin"].partition("@")
        self.margin, self.request_carry = float(margin), float(carry or ad.PLAN_CARRY)
    return orig_best(self)
ad.AdaptiveK.best_k = best_k
steps = []  # (margin, cat, rows, accepted, seconds)
orig_finish = BatchEngine._finish_decode
def finish(self, plan, logits, target_seconds, shared):
    out = orig_finish(self, plan, logits, target_seconds, shared)
    n = len(plan.proposed); acc = sum(1 for f in out.from_draft if f)
    steps.append((current["variant"], current["cat"], n + 1, acc, target_seconds))
    return out
BatchEngine._finish_decode = finish
for m in margins:
    current["margin"] = m; current["variant"] = "warm"
    dec.engine(specs[m]).generate(dec.encode("Hello"), SamplingParams(max_tokens=8, temperature=0.0))
wall = collections.defaultdict(float)
for i, r in enumerate(prompts):
    ids = dec.encode(r["turns"][0])
    order = margins[i % len(margins):] + margins[:i % len(margins)]
    for m in order:
        eng = dec.engine(specs[m]); release_retained(dec.target)
        current.update(margin=m, variant=m, cat=r["category"])
        t = time.perf_counter(); g = eng.generate(ids, params); t = time.perf_counter() - t
        wall[(m, r["category"])] += t - g.stats.prefill_seconds
json.dump(steps, open(os.environ.get("STEPLOG", "/tmp/prof/margin_steps.json"), "w"))
# the engine's own cost per row count (all variants pooled)
by_rows = collections.defaultdict(list)
for v, c, n, a, s in steps:
    if v != "warm": by_rows[n].append(s)
cost = {n: sorted(v)[len(v) // 2] for n, v in by_rows.items()}
print("median s per pass by rows:", {n: round(1000 * cost[n], 1) for n in sorted(cost)}, "counts", {n: len(by_rows[n]) for n in sorted(by_rows)})
c1 = cost[1]
code = {"code_edit", "humaneval"}
for m in margins:
    for group in ("chat", "code"):
        drafted = [(n, a) for v, c, n, a, s in steps if v == m and n > 1 and ((c in code) == (group == "code"))]
        extra = sum(cost.get(n, c1 * n) - c1 for n, a in drafted); saved = sum(a * c1 for n, a in drafted)
        dwall = sum(w for (mm, c), w in wall.items() if mm == m and ((c in code) == (group == "code")))
        print(f"margin {m} {group}: drafting steps {len(drafted)} rows {sum(n - 1 for n, a in drafted)} accepted {sum(a for n, a in drafted)} extra {extra:.2f}s saved {saved:.2f}s net {saved - extra:+.2f}s decode wall {dwall:.1f}s")
    for c in cats:
        drafted = [(n, a) for v, cc, n, a, s in steps if v == m and cc == c and n > 1]
        extra = sum(cost.get(n, c1 * n) - c1 for n, a in drafted); saved = sum(a * c1 for n, a in drafted)
        print(f"   {c}: steps {len(drafted)} net {saved - extra:+.2f}s wall {wall[(m, c)]:.1f}s")
