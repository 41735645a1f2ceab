"""Per long request: every step from its arrival in `running` to its first token: seconds, rows, whose prompt chunk."""
import json, glob, sys
for f in sorted(glob.glob(sys.argv[1] + '.*[0-9]')):
    recs = [json.loads(l) for l in open(f)]
    if max(len(r['running']) for r in recs) < 2:
        continue
    def chunk_of(i):
        now = {x[0]: x for x in recs[i]['running']}
        nxt = {x[0]: x for x in recs[i + 1]['running']} if i + 1 < len(recs) else {}
        for rid, (_, plen, pre, ing) in now.items():
            if ing:
                after = nxt.get(rid)
                done = after[2] if after and after[3] else plen
                if done > pre:
                    return rid, done - pre, plen
        return None
    seen = {}
    for i, r in enumerate(recs):
        for rid, plen, pre, ing in r['running']:
            seen.setdefault(rid, (i, plen))
    tot_own = tot_other = tot_dec = 0
    for rid, (first, plen) in sorted(seen.items()):
        if plen < 600:
            continue
        parts = []; i = first; own = other = dec = 0.0
        while i < len(recs):
            c = chunk_of(i); r = recs[i]
            if c and c[0] == rid:
                own += r['dt']; parts.append(f"OWN {r['dt']:.2f}s {c[1]}+{r['rows']-c[1]}r")
            elif c:
                other += r['dt']; parts.append(f"other#{c[0]}({c[2]}) {r['dt']:.2f}s {c[1]}+{r['rows']-c[1]}r")
            else:
                dec += r['dt']; parts.append(f"dec {r['dt']:.2f}s {r['rows']}r")
            still = [x for x in recs[i + 1]['running'] if x[0] == rid] if i + 1 < len(recs) else []
            if not still or not still[0][3]:
                break
            i += 1
        print(f"req {rid} plen {plen}: own {own:.2f} other-prompts {other:.2f} decode-only {dec:.2f} | " + " ; ".join(parts))
    dsteps = [r for r in recs if all(not x[3] for x in r['running']) and len(r["running"]) == max(len(x["running"]) for x in recs)]
    print('decode-only 4-stream steps', len(dsteps), 'mean dt %.3f mean rows %.1f' % (sum(r['dt'] for r in dsteps) / len(dsteps), sum(r['rows'] for r in dsteps) / len(dsteps)))
