"""oneDNN and MKL (torch bf16) beside llama.cpp's AMX kernels on one thread: capped by `import specdec`, and the crash it prevents (negative control)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specdec.host.amx_guard import MKL_CAP, ONEDNN_CAP, keep_onednn_off_amx
from specdec.host.native_build import cpu_flags

TESTS = Path(__file__).parent


def test_the_cap_is_set_only_on_amx_cpus_and_never_over_a_users_choice():
    amx = frozenset({"avx512f", "amx_tile", "amx_int8"})
    env: dict[str, str] = {}
    assert keep_onednn_off_amx(env, amx) == ["ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"]
    assert env == {"ONEDNN_MAX_CPU_ISA": ONEDNN_CAP, "MKL_ENABLE_INSTRUCTIONS": MKL_CAP}
    env = {}
    assert keep_onednn_off_amx(env, frozenset({"avx512f", "avx2"})) == [] and env == {}
    for mine in ({"ONEDNN_MAX_CPU_ISA": "ALL"}, {"DNNL_MAX_CPU_ISA": "AVX2"}):
        env = dict(mine)
        assert keep_onednn_off_amx(env, amx) == ["MKL_ENABLE_INSTRUCTIONS"] and env == {**mine, "MKL_ENABLE_INSTRUCTIONS": MKL_CAP}
    env = {"ONEDNN_MAX_CPU_ISA": "ALL", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E4"}
    assert keep_onednn_off_amx(env, amx) == [] and len(env) == 2


# One thread: a 16-row llama.cpp pass with AMX weights, a torch bf16 matmul, the same pass again.
_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import specdec, torch
    from specdec.backends.llamacpp.backend import LlamaCppBackend
    backend = LlamaCppBackend({model!r}, max_context=128, threads=1, batch_invariant=False)
    assert backend.amx, backend.runtime_summary()
    tokens = [(i * 13) % 250 for i in range(16)]
    cache = backend.new_cache()
    backend.forward(tokens, cache, num_logits=16)
    x = torch.randn(128, 128, dtype=torch.bfloat16)
    print(float((x @ x).sum()))
    cache.trim(cache.length)
    backend.forward(tokens, cache, num_logits=16)
    print("second pass ok")
""")


@pytest.mark.skipif(not {"amx_tile", "amx_int8", "avx512_vnni"} <= cpu_flags(), reason="this CPU has no AMX")
def test_torch_bf16_between_two_amx_passes_on_one_thread(tmp_path):
    from specdec.backends.llamacpp.backend import build_features

    if not build_features().get("AMX_INT8"):
        pytest.skip("this llama.cpp library was built without AMX")
    from tiny_gguf import quantize_q4_k_m, write_tiny_gguf

    model = quantize_q4_k_m(write_tiny_gguf(tmp_path / "w.gguf", seed=3, hidden=256, ffn=512), tmp_path / "q.gguf")
    script = _SCRIPT.format(tests=str(TESTS), model=str(model))

    def run(**env):
        import os

        caps = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
        environ = {k: v for k, v in os.environ.items() if k not in caps}
        environ.update(env, SPECDEC_CACHE=str(tmp_path / "cache"))
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environ,
                              timeout=300)

    guarded = run()
    assert guarded.returncode == 0 and "second pass ok" in guarded.stdout, guarded.stderr[-2000:]
    # Negative control: oneDNN allowed AMX (a user's explicit choice) releases the tiles and the second pass dies.
    unguarded = run(ONEDNN_MAX_CPU_ISA="ALL")
    assert unguarded.returncode != 0 and "second pass ok" not in unguarded.stdout
