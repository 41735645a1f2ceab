"""In-engine: per chat category, decode seconds per token of plain vs the default suffix drafter, and per-source step logs."""
import json, sys, time, collections
sys.path.insert(0, "/work/main/src")
from specdec.config import ModelRef, SpecConfig, SamplingParams
from specdec.pipeline import SpecDecoder
from specdec.kvcache import release_retained
from specdec.scheduler import BatchEngine
from specdec.config import adaptive_max_k

cats = sys.argv[1].split(",")
per = int(sys.argv[2])
variants = sys.argv[3].split(",")  # names of spec variants below
rows = [json.loads(l) for l in open("/work/shared/data/spec_bench_dev.jsonl")]
prompts = []
from specdec.bench.datasets import load_tasks
for c in cats:
    if c in ("code_edit", "humaneval"):
        prompts += [{"category": c, "turns": [p.text]} for p in load_tasks([c], per)]
    else:
        prompts += [r for r in rows if r["category"] == c][:per]
steplog = []
dec = SpecDecoder.load(ModelRef(draft=None, threads=2))
params = SamplingParams(max_tokens=128, temperature=0.0)
K = adaptive_max_k("suffix", False)
SPECS = {
    "plain": SpecConfig(drafter="none"),
    "suffix": SpecConfig(drafter="suffix", k_policy="adaptive", num_speculative_tokens=K),
}
import os
import specdec.adaptive as _sch  # the PLAN_* settings (in specdec.scheduler when these logs were made)
VARIANT_KNOBS = json.loads(os.environ.get("KNOBS", "{}"))  # variant -> [decay, doubt]
extra = os.environ.get("EXTRA_SPECS")
if extra:
    for name, kw in json.loads(extra).items():
        SPECS[name] = SpecConfig(drafter="suffix", k_policy="adaptive", num_speculative_tokens=K, **kw)
log = collections.defaultdict(lambda: collections.Counter())
orig_choose = BatchEngine._choose_k
current = {"variant": "warm", "cat": "warm"}
def choose(self, sequence, other_rows, other_sequences):
    policy, k = orig_choose(self, sequence, other_rows, other_sequences)
    current["k"] = k
    current["explore"] = policy is not None and getattr(policy, "_explored_from", None) is not None
    dr = sequence.slot.drafter
    pl = getattr(dr, "_planned", None)
    if pl is not None and pl[1].tokens:
        m = pl[1].match_length
        current["meta"] = (m, pl[1].longest_match, pl[1].probs[0], min(pl[1].probs[:max(k,1)]))
        current["src"] = ("1-2" if m <= 2 else "3-7" if m <= 7 else "8+") + ("E" if current["explore"] else "")
    else:
        current["src"] = "-"
    return policy, k
BatchEngine._choose_k = choose
orig_finish = BatchEngine._finish_decode
def finish(self, plan, logits, target_seconds, shared):
    out = orig_finish(self, plan, logits, target_seconds, shared)
    n = len(plan.proposed); acc = len([f for f in out.from_draft if f]) if hasattr(out, "from_draft") else 0
    key = current.get("variant")
    d = log[key]
    d["steps"] += 1; d["rows"] += n + 1; d["drafted"] += n; d["accepted"] += acc
    d[f"k{min(n,9)}"] += 1; d[f"acc_k{min(n,9)}"] += acc
    d["target_s"] += target_seconds
    if n:
        steplog.append((current["variant"], current["cat"], current["src"], n, acc) + current.get("meta", ()))
        d["src_" + current["src"] + "_n"] += 1; d["src_" + current["src"] + "_drafted"] += n; d["src_" + current["src"] + "_acc"] += acc
    return out
BatchEngine._finish_decode = finish
res = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0, 0.0]))
for v in variants:
    if v in VARIANT_KNOBS: _sch.PLAN_DECAY, _sch.PLAN_DOUBT, _sch.PLAN_CARRY = VARIANT_KNOBS[v]
    eng = dec.engine(SPECS[v]); eng.generate(dec.encode("Hello"), SamplingParams(max_tokens=8, temperature=0.0))
for i, r in enumerate(prompts):
    ids = dec.encode(r["turns"][0])
    order = variants[i % len(variants):] + variants[:i % len(variants)]
    for v in order:
        eng = dec.engine(SPECS[v])
        release_retained(dec.target)
        current["variant"] = v; current["cat"] = r["category"]
        base = v.split("@")[0]
        if v in VARIANT_KNOBS: _sch.PLAN_DECAY, _sch.PLAN_DOUBT, _sch.PLAN_CARRY = VARIANT_KNOBS[v]
        t = time.perf_counter(); g = eng.generate(ids, params); t = time.perf_counter() - t
        st = g.stats
        acc = res[v][r["category"]]
        acc[0] += t - st.prefill_seconds; acc[1] += len(g.tokens); acc[2] += t
        log[v]["decode_wall"] += t - st.prefill_seconds
print("decode ms/token per category (wall minus prefill) / tokens")
for c in cats + ["ALL"]:
    line = [c]
    for v in variants:
        if c == "ALL":
            s = sum(x[0] for x in res[v].values()); n = sum(x[1] for x in res[v].values())
        else:
            s, n, _ = res[v][c]
        line.append(f"{v} {1000*s/n:.2f} ({n})")
    base = None
    print(" | ".join(line))
for v in variants:
    d = log[v]
    print(v, {k: (round(x, 3) if isinstance(x, float) else x) for k, x in d.items()})
    print(v, "non-target ms/step", round(1000 * (d["decode_wall"] - d["target_s"]) / d["steps"], 3), "target ms/step", round(1000 * d["target_s"] / d["steps"], 2))

json.dump(steplog, open(os.environ.get("STEPLOG", "/tmp/prof/steplog.json"), "w"))
