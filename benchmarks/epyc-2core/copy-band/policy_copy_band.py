"""In-engine: the default suffix drafter's drafting steps with and without the copy band (a verbatim copy in progress
gets its own k policy, acceptance pooled over positions), priced on the engine's calibrated pass-cost curve and on
its own passes. Variants: "per-position" (before: copies fall in the 8+ band, acceptance per position) and
"pooled@D" (the copy band, D pseudo-rejections of doubt). Prompts: [first, first + per) of each category, variants
interleaved per prompt (order rotated), greedy, 128 new tokens, each variant its own engine and cross-request cache.
Usage: PYTHONPATH=src THREADS=2 python policy_copy_band.py code_edit,humaneval,summarization,rag 3:4 per-position,pooled@1"""
import collections, json, os, sys, time
from specdec import adaptive
from specdec.bench.datasets import select_prompts, spec_bench_path
from specdec.config import ModelRef, SamplingParams, SpecConfig
from specdec.calibration import interpolate_cost
from specdec.drafters import suffix
from specdec.kvcache import release_retained
from specdec.pipeline import SpecDecoder
from specdec.scheduler import BatchEngine

cats = sys.argv[1].split(","); first, per = map(int, sys.argv[2].split(":")); variants = sys.argv[3].split(",")
threads = int(os.environ.get("THREADS", "2"))
rows = [json.loads(line) for line in open(spec_bench_path())]
prompts = []
for c in cats:
    if c in ("code_edit", "humaneval"):
        prompts += [(c, p.text) for p in select_prompts(c, None, first + per, 1)[first:]]
    else:
        prompts += [(c, r["turns"][0]) for r in rows if r["category"] == c][first:first + per]
dec = SpecDecoder.load(ModelRef(draft=None, threads=threads))
params = SamplingParams(max_tokens=128, temperature=0.0)
specs = {v: SpecConfig(drafter="suffix", k_policy="adaptive", num_speculative_tokens=32, suffix_cache_tokens=8192 + i)
         for i, v in enumerate(variants)}
current = {"variant": "warm", "cat": None}

new_next_source = suffix.SuffixDrafter.next_source
def next_source(self, context):
    source = new_next_source(self, context)
    if current["variant"] == "per-position" and source and source.endswith("-copy"):
        m = self._planned[1].match_length  # the bands as they were: by the winning draft's match length
        source = source.rsplit("-", 1)[0] + "-" + ("1-2" if m <= 2 else ("3-7" if m <= 7 else "8+"))
    return source
suffix.SuffixDrafter.next_source = next_source
original_rates = adaptive.AdaptiveK.acceptance_per_pos
def acceptance_per_pos(self):
    if current["variant"].startswith("pooled@"):
        adaptive.POOLED_DOUBT = float(current["variant"].split("@")[1])
    return original_rates(self)
adaptive.AdaptiveK.acceptance_per_pos = acceptance_per_pos

steps = []  # (variant, category, rows, accepted, seconds)
original_finish = BatchEngine._finish_decode
def finish(self, plan, logits, target_seconds, shared):
    out = original_finish(self, plan, logits, target_seconds, shared)
    steps.append((current["variant"], current["cat"], len(plan.proposed) + 1, sum(1 for f in out.from_draft if f),
                  target_seconds))
    return out
BatchEngine._finish_decode = finish

for v in variants:
    current["variant"] = v
    dec.engine(specs[v]).generate(dec.encode("Hello"), SamplingParams(max_tokens=8, temperature=0.0))
curve = dict(dec.target.pass_costs)
wall = collections.defaultdict(float)
for i, (c, text) in enumerate(prompts):
    ids = dec.encode(text)
    for v in variants[i % len(variants):] + variants[:i % len(variants)]:
        engine = dec.engine(specs[v]); release_retained(dec.target)
        current.update(variant=v, cat=c)
        t = time.perf_counter(); g = engine.generate(ids, params); t = time.perf_counter() - t
        wall[(v, c)] += t - g.stats.prefill_seconds
json.dump({"curve_ms": {n: 1000 * s for n, s in curve.items()}, "steps": steps},
          open(os.environ.get("STEPLOG", "copy_band_steps.json"), "w"))
by_rows = collections.defaultdict(list)
for v, c, n, a, s in steps:
    if v != "warm":
        by_rows[n].append(s)
own = {n: sorted(x)[len(x) // 2] for n, x in by_rows.items()}
level = own[1] / interpolate_cost(curve, 1)
print("calibrated curve ms:", {n: round(1000 * s, 1) for n, s in sorted(curve.items())}, "level of this run", round(level, 3))
print("own passes, median ms:", {n: round(1000 * own[n], 1) for n in sorted(own)}, "counts",
      {n: len(by_rows[n]) for n in sorted(by_rows)})
code = {"code_edit", "humaneval"}
def net(selected, price):
    c1 = price(1)
    return sum(a * c1 - (price(n) - c1) for n, a in selected)
calibrated = lambda n: level * interpolate_cost(curve, n)
measured = lambda n: own.get(n, calibrated(n))
for v in variants:
    for group in ("chat", "code"):
        drafted = [(n, a) for vv, c, n, a, s in steps if vv == v and n > 1 and ((c in code) == (group == "code"))]
        decode = sum(w for (vv, c), w in wall.items() if vv == v and ((c in code) == (group == "code")))
        print(f"{v} {group}: drafting steps {len(drafted)} rows {sum(n - 1 for n, a in drafted)} accepted "
              f"{sum(a for n, a in drafted)} net on curve {net(drafted, calibrated):+.2f}s on own passes "
              f"{net(drafted, measured):+.2f}s decode wall {decode:.1f}s")
    for c in cats:
        drafted = [(n, a) for vv, cc, n, a, s in steps if vv == v and cc == c and n > 1]
        print(f"   {c}: steps {len(drafted)} net on curve {net(drafted, calibrated):+.2f}s on own "
              f"{net(drafted, measured):+.2f}s decode wall {wall[(v, c)]:.1f}s")
