"""ttft_profile.py with llama.cpp's KV layout forced: KVU=1 one unified buffer (the fast mode's default), KVU=0 one
KV stream per sequence (exact mode's with parallel > 1, and llama-server's with an explicit -np).

    KVU=0 python benchmarks/serve-2core/kv_layout.py 8 128 none
"""

import os
import runpy
import sys
from pathlib import Path

from specdec.backends import llamacpp_backend

flag = os.environ.get("KVU")
if flag is not None:
    original = llamacpp_backend.LlamaCppBackend.__init__

    def forced(self, *args, **kwargs):
        kwargs["kv_unified"] = flag == "1"
        return original(self, *args, **kwargs)

    llamacpp_backend.LlamaCppBackend.__init__ = forced
sys.argv = ["ttft_profile.py"] + sys.argv[1:]
runpy.run_path(str(Path(__file__).with_name("ttft_profile.py")), run_name="__main__")
