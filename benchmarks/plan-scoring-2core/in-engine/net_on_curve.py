import json, collections, sys
curve = {1:34.8,2:54.6,3:75.8,4:91.5,5:114.6,6:135.3,8:220.7,9:232.9,16:263.6,17:291.1,32:443.4,33:462.3}
pts = sorted(curve.items())
def c(n):
    for (a, ca), (b, cb) in zip(pts, pts[1:]):
        if a <= n <= b: return ca + (cb - ca) * (n - a) / (b - a)
    return pts[-1][1]
code = {"code_edit", "humaneval"}
for f in sys.argv[1:]:
    log = [r for r in json.load(open(f)) if r[0] != "warm"]
    agg = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for v, cat, src, n, acc, *_ in log:
        key = (v, "code" if cat in code else "chat")
        a = agg[key]; a[0] += c(n + 1) - c(1); a[1] += acc * c(1); a[2] += 1
    for k in sorted(agg):
        spent, saved, steps = agg[k]
        print(f, k, f"steps {steps} extra {spent/1000:.2f}s saved {saved/1000:.2f}s net {(saved-spent)/1000:+.2f}s")
