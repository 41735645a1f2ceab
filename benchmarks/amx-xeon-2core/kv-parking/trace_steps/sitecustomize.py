"""Trace every BatchEngine.step of a specdec server into $SPECDEC_TRACE (one JSON line per step)."""
import json, os, time
path = os.environ.get("SPECDEC_TRACE")
if path:
    import specdec.scheduler as sch
    original = sch.BatchEngine.step
    def step(self):
        before = [(s.request_id, len(s.prompt), s.prefilled, s.prefilling) for s in self.running]
        t0 = time.perf_counter()
        out = original(self)
        t1 = time.perf_counter()
        b = self.target
        rec = {"t0": t0, "dt": t1 - t0, "running": before, "rows": getattr(b, "last_pass_rows", None),
               "decodes": getattr(b, "last_pass_decodes", None), "seqs": getattr(b, "last_pass_sequences", None),
               "out": [(o.sequence.request_id, len(o.tokens) if hasattr(o, "tokens") else None) for o in out]}
        with open(path + f".{os.getpid()}", "a") as f:
            f.write(json.dumps(rec) + "\n")
        return out
    sch.BatchEngine.step = step
