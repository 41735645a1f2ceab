"""Summarise a step trace of our server (SPECDEC_TRACE with ../../amx-xeon-2core/kv-parking/trace_steps): steps, seconds in
steps that carry prompt rows and in decode-only steps, tokens out, and the median seconds per (llama_decode calls, rows)."""
import json, sys, statistics, collections
for f in sys.argv[1:]:
    recs = [json.loads(l) for l in open(f)]
    dec = [r for r in recs if all(not x[3] for x in r['running'])]
    pre = [r for r in recs if any(x[3] for x in r['running'])]
    out = sum(sum(n for _, n in r['out']) for r in recs)
    dec_out = sum(sum(n for _, n in r['out']) for r in dec)
    print(f"{f.split('/')[-1]}: steps {len(recs)} total {sum(r['dt'] for r in recs):.1f}s tokens out {out}; "
          f"prefill-carrying steps {len(pre)} {sum(r['dt'] for r in pre):.1f}s; decode-only {len(dec)} steps "
          f"{sum(r['dt'] for r in dec):.1f}s rows {sum(r['rows'] for r in dec)} out {dec_out} "
          f"({1000*sum(r['dt'] for r in dec)/max(dec_out,1):.1f} ms/token)")
    by = collections.defaultdict(list)
    for r in dec:
        by[(r['decodes'], r['rows'])].append(r['dt'])
    common = sorted(by.items(), key=lambda kv: -len(kv[1]))[:8]
    print('   ', ' '.join(f"{d}decode-call/{rows}rows:{1000*statistics.median(v):.0f}ms x{len(v)}" for (d, rows), v in common))
