"""Keeps PyTorch's oneDNN and MKL off AMX in our processes on AMX CPUs, so that llama.cpp's AMX kernels keep their tile configuration.

ggml (llama.cpp) loads its AMX tile configuration once per thread (`ggml_tile_config_init`, a
thread-local "done" flag) and never again. oneDNN, which PyTorch uses for bf16 and int8 CPU matmuls,
releases the tiles after each of its AMX kernels (TILERELEASE). The calling thread is shared (ggml's
OpenMP master is the thread that calls llama_decode), so after one torch bf16 matmul the next
multi-row llama.cpp pass with AMX weights executes a tile instruction without a configuration and
the process dies with SIGILL (measured on a 2-vCPU AMX Xeon: tests/test_amx_guard.py). MKL's bf16
gemm does the same (a bf16 distillation step in the test suite killed the next AMX pass). Both read
their cap once, at their first kernel, so this must run before torch computes anything: `import
specdec` does it. A user who sets a cap keeps their value (and the risk).
"""

from __future__ import annotations

import os

from specdec.host.native_build import cpu_flags

# The best instruction sets below AMX; each library picks the best the CPU has up to its cap.
ONEDNN_CAP = "AVX512_CORE_BF16"
MKL_CAP = "AVX512_E3"  # AVX-512 with BF16; AVX512_E4 adds AMX


def keep_onednn_off_amx(environ=os.environ, flags: frozenset[str] | None = None) -> list[str]:
    """Cap oneDNN and MKL below AMX where the CPU has AMX, each unless a cap is set; the variables set."""
    if "amx_tile" not in (cpu_flags() if flags is None else flags):
        return []
    chosen = []
    if "ONEDNN_MAX_CPU_ISA" not in environ and "DNNL_MAX_CPU_ISA" not in environ:
        environ["ONEDNN_MAX_CPU_ISA"] = ONEDNN_CAP
        chosen.append("ONEDNN_MAX_CPU_ISA")
    if "MKL_ENABLE_INSTRUCTIONS" not in environ:
        environ["MKL_ENABLE_INSTRUCTIONS"] = MKL_CAP
        chosen.append("MKL_ENABLE_INSTRUCTIONS")
    return chosen
