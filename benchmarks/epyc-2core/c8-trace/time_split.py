"""Where a traced serving level's time went: per step kind (prefill chunk or decode only) and running count, the
steps, seconds, tokens out and rows; then the prompt rows prefilled and the seconds of the steps that did it.

    python benchmarks/epyc-2core/c8-trace/time_split.py benchmarks/epyc-2core/c8-trace/steps.jsonl
"""
import json
import sys
from collections import defaultdict

records = [json.loads(line) for line in open(sys.argv[1])]
span = records[-1]["t0"] + records[-1]["dt"] - records[0]["t0"]
print(f"span {span:.1f} s, in steps {sum(r['dt'] for r in records):.1f} s, {len(records)} steps")
kinds = defaultdict(lambda: [0, 0.0, 0, 0])
prompt_rows = prompt_seconds = 0.0
for i, record in enumerate(records):
    prefilling = [x for x in record["running"] if x[3]]
    key = ("prefill" if prefilling else "decode", len(record["running"]))
    entry = kinds[key]
    entry[0] += 1
    entry[1] += record["dt"]
    entry[2] += sum(out[1] or 0 for out in record["out"])
    entry[3] += record["rows"] or 0
    if prefilling:
        after = {x[0]: x for x in records[i + 1]["running"]} if i + 1 < len(records) else {}
        for request, length, done, _ in prefilling:
            later = after.get(request)
            prompt_rows += (later[2] if later and later[3] else length) - done
        prompt_seconds += record["dt"]
for (kind, running), (steps, seconds, tokens, rows) in sorted(kinds.items()):
    print(f"{kind:7s} {running} running: {steps:3d} steps {seconds:5.1f} s, {tokens:4d} tokens out, {rows:5d} rows, "
          f"{1e3 * seconds / steps:.0f} ms/step, {tokens / seconds:.1f} tok/s")
print(f"prompt rows prefilled {prompt_rows:.0f} in {prompt_seconds:.1f} s of steps that prefilled (the others' decode "
      f"passes of those steps included)")
