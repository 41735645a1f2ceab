"""The CPU-flags -> llama.cpp build options map, the library/CPU mismatch check, and (on AMX CPUs) an AMX pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specdec.host.native_build import (
    amx_decision,
    cmake_args,
    cpu_flags,
    expected_library_features,
    library_mismatch,
    rebuild_command,
)

BASE = {"fpu", "sse4_2", "avx", "avx2", "bmi2", "fma", "f16c"}  # a portable x86-64 CPU of today
AVX512 = {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}
# Flags as /proc/cpuinfo spells them on the three machines this project runs on.
AVX2_EPYC = frozenset(BASE)
AVX512_EPYC = frozenset(BASE | AVX512 | {"avx512_vnni", "avx512vbmi", "avx512_bf16"})
AMX_XEON = frozenset(AVX512_EPYC | {"avx_vnni", "amx_tile", "amx_int8", "amx_bf16"})


def options(args: list[str]) -> dict[str, str]:
    return {arg[2:].split("=")[0]: arg.split("=", 1)[1] for arg in args if arg.startswith("-DGGML_")}


def test_avx2_only_cpu_gets_the_portable_set_and_nothing_more():
    got = options(cmake_args(AVX2_EPYC))
    assert got["GGML_NATIVE"] == "OFF" and got["GGML_LLAMAFILE"] == "OFF"
    assert all(got[o] == "ON" for o in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2"))
    assert all(got[o] == "OFF" for o in got if "AVX512" in o or "AMX" in o or o == "GGML_AVX_VNNI")
    assert not any("fno-dse" in a for a in cmake_args(AVX2_EPYC))


def test_avx512_vnni_cpu_gets_avx512_and_no_amx():
    got = options(cmake_args(AVX512_EPYC))
    assert all(got[o] == "ON" for o in ("GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_VBMI", "GGML_AVX512_BF16"))
    assert all(got[o] == "OFF" for o in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16", "GGML_AVX_VNNI"))


def test_amx_cpu_gets_amx_with_the_flag_that_keeps_the_tile_config():
    args = cmake_args(AMX_XEON, ("gcc", 12))
    got = options(args)
    assert all(got[o] == "ON" for o in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16", "GGML_AVX512_VNNI"))
    assert "-DCMAKE_CXX_FLAGS=-fno-dse" in args and "-DCMAKE_C_FLAGS=-fno-dse" in args
    # clang (14 spells the macro __AMXINT8__) or an explicit opt-out: no AMX, and the reason is given.
    for compiler, allow in ((("clang", 14), True), (("gcc", 12), False)):
        got = options(cmake_args(AMX_XEON, compiler, allow))
        assert got["GGML_AMX_INT8"] == "OFF" and got["GGML_AVX512"] == "ON"
        assert amx_decision(AMX_XEON, compiler, allow)[0] is False
    assert "clang" in amx_decision(AMX_XEON, ("clang", 14))[1]


def test_a_partial_avx512_cpu_does_not_get_avx512():
    # GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw: a CPU missing one of them must not get it.
    got = options(cmake_args(frozenset(BASE | {"avx512f", "avx512cd"})))
    assert got["GGML_AVX512"] == "OFF"


def test_library_mismatch_names_what_a_portable_build_leaves_out():
    portable = {"AVX": True, "AVX2": True, "FMA": True, "F16C": True, "BMI2": True, "REPACK": True}
    missing, unsupported = library_mismatch(portable, AVX512_EPYC)
    assert missing == ["AVX512", "AVX512_BF16", "AVX512_VBMI", "AVX512_VNNI"] and unsupported == []
    native = {name: True for name in expected_library_features(cmake_args(AVX512_EPYC))}
    assert library_mismatch(native, AVX512_EPYC) == ([], [])
    # Negative control: the same native library on an AVX2-only CPU uses what that CPU lacks.
    assert library_mismatch(native, AVX2_EPYC)[1] == ["AVX512", "AVX512_BF16", "AVX512_VBMI", "AVX512_VNNI"]
    assert "AMX_INT8" in library_mismatch(native, AMX_XEON)[0]


def test_cpuinfo_parsing_and_the_script(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx", "avx2", "avx512f"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()
    script = Path(__file__).resolve().parents[1] / "src" / "specdec" / "host" / "native_build.py"
    # The README runs the file directly, before specdec is installed: it must need nothing but the stdlib.
    out = subprocess.run([sys.executable, "-S", str(script)], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("-DGGML_NATIVE=OFF -DGGML_LLAMAFILE=OFF") and "specdec: llama.cpp" in out.stderr
    assert "--no-cache-dir" in rebuild_command(cmake_args(AVX2_EPYC))


@pytest.mark.skipif(not {"amx_tile", "amx_int8", "avx512_vnni"} <= cpu_flags(), reason="this CPU has no AMX")
def test_amx_multi_row_pass_runs_and_agrees_with_the_non_amx_kernels(tmp_path, monkeypatch):
    from specdec.backends.llamacpp.backend import build_features

    if not build_features().get("AMX_INT8"):
        pytest.skip("this llama.cpp library was built without AMX (see native_build.py)")
    from specdec.backends.llamacpp.probe import amx_rows_agree
    from tiny_gguf import quantize_q4_k_m, write_tiny_gguf

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    model = quantize_q4_k_m(write_tiny_gguf(tmp_path / "w.gguf", seed=3, hidden=256, ffn=512), tmp_path / "q.gguf")
    verdict = amx_rows_agree(model, threads=2)
    assert verdict["ok"], verdict
