"""Experiment: force one KV stream per sequence (kv_unified off) in fast mode too; and trace steps."""
import os, sys
sys.path.insert(0, "/work/main/benchmarks/amx-xeon-2core/kv-parking/trace_steps")
import importlib.util
spec = importlib.util.spec_from_file_location("trace_site", "/work/main/benchmarks/amx-xeon-2core/kv-parking/trace_steps/sitecustomize.py")
spec.loader.exec_module(importlib.util.module_from_spec(spec))
if os.environ.get("FORCE_STREAMS") == "1":
    import specdec.backends.llamacpp_backend as lb
    orig = lb.LlamaCppBackend.__init__
    def init(self, *a, **kw):
        if kw.get("parallel", 1) > 1:
            kw["kv_unified"] = False
        orig(self, *a, **kw)
    lb.LlamaCppBackend.__init__ = init
