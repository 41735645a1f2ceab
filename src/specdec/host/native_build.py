"""The llama.cpp build options for the CPU this runs on: CPU flags in, CMAKE_ARGS out (stdlib only, runnable as a script).

The install builds llama-cpp-python from source; its CMAKE_ARGS decide which instruction sets ggml may
use. `GGML_NATIVE=ON` (`-march=native`) would do, except on Intel CPUs with AMX under gcc 12: gcc drops
the stores that fill ggml's AMX tile configuration on the stack (ggml-cpu/amx/mmq.cpp
`ggml_tile_config_init`; it does not know `ldtilecfg` reads them), so the first pass of 2+ rows faults.
The stores are dropped by gcc's RTL dead-store elimination; `-fno-dse` keeps them (checked on that
file's object code with gcc 12.2 -O3: without it only the palette byte is stored before ldtilecfg).
So every option is set explicitly from /proc/cpuinfo, and AMX comes with `-fno-dse`.
clang 14 spells the AMX macro `__AMXINT8__`, which ggml does not test, so with clang AMX is left off
and we say so. Whether an AMX build really runs is proven again at first load (backends/llamacpp/probe.py).

    CMAKE_ARGS="$(python3 src/specdec/host/native_build.py)" pip install -e .      # what the README does
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

# Switches every specdec build has: tinyBLAS computes 2+ rows differently from one (breaks --exact) and
# does not cover the K-quants the default pair uses; the multimodal library is not needed.
BASE_ARGS = ("-DGGML_NATIVE=OFF", "-DGGML_LLAMAFILE=OFF", "-DLLAVA_BUILD=OFF")

# ggml option -> the /proc/cpuinfo flags it needs (GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw).
ISA_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512f", "avx512vbmi"),
    "GGML_AVX512_VNNI": ("avx512f", "avx512_vnni"),
    "GGML_AVX512_BF16": ("avx512f", "avx512_bf16"),
}
AMX_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_AMX_TILE": ("amx_tile",),
    "GGML_AMX_INT8": ("amx_tile", "amx_int8"),
    "GGML_AMX_BF16": ("amx_tile", "amx_bf16"),
}
# ggml's AMX kernels are compiled only with AVX512-VNNI as well (ggml-cpu/amx/common.h).
AMX_NEEDS = ("amx_tile", "amx_int8", "avx512f", "avx512_vnni")
AMX_COMPILER_FLAGS = ("-DCMAKE_C_FLAGS=-fno-dse", "-DCMAKE_CXX_FLAGS=-fno-dse")

# What llama_print_system_info() reports for each option (the loaded library's compiled features).
LIBRARY_FEATURE = {
    "GGML_AVX": "AVX", "GGML_AVX2": "AVX2", "GGML_BMI2": "BMI2", "GGML_FMA": "FMA", "GGML_F16C": "F16C",
    "GGML_AVX_VNNI": "AVX_VNNI", "GGML_AVX512": "AVX512", "GGML_AVX512_VBMI": "AVX512_VBMI",
    "GGML_AVX512_VNNI": "AVX512_VNNI", "GGML_AVX512_BF16": "AVX512_BF16", "GGML_AMX_INT8": "AMX_INT8",
}


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's flags from /proc/cpuinfo (empty where there is none, e.g. not Linux)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The first processor's model name from /proc/cpuinfo (None where there is none)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def compiler_family(command: str | None = None) -> tuple[str, int]:
    """("gcc" | "clang" | "unknown", major version) of the C compiler CMake will pick ($CC, else cc)."""
    command = command or os.environ.get("CC") or "cc"
    if shutil.which(command) is None:
        return "unknown", 0
    try:
        text = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown", 0
    family = "clang" if "clang" in text.lower() else "gcc" if re.search(r"gcc|free software", text, re.I) else "unknown"
    version = re.search(r"(\d+)\.\d+(?:\.\d+)?", text)
    return family, int(version.group(1)) if version else 0


def isa_options(flags: frozenset[str] | set[str]) -> dict[str, bool]:
    """Each non-AMX instruction-set option of ggml, on exactly when the CPU has every flag it needs."""
    return {option: all(flag in flags for flag in needs) for option, needs in ISA_OPTIONS.items()}


def amx_decision(flags: frozenset[str] | set[str], compiler: tuple[str, int], allow: bool = True) -> tuple[bool, str]:
    """(build with AMX?, why) for this CPU and compiler."""
    if not all(flag in flags for flag in AMX_NEEDS):
        return False, "the CPU has no AMX (or no AVX512-VNNI, which ggml's AMX kernels also need)"
    if not allow:
        return False, "AMX turned off (SPECDEC_AMX=0)"
    if compiler[0] != "gcc":
        return False, (f"AMX needs gcc here: {compiler[0]} {compiler[1]} does not define the __AMX_INT8__ macro "
                       "ggml tests (clang 14 spells it __AMXINT8__), so AMX would be silently absent")
    return True, "AMX on, compiled with -fno-dse so gcc keeps ggml's tile configuration"


def cmake_args(flags: frozenset[str] | set[str], compiler: tuple[str, int] = ("gcc", 12),
               allow_amx: bool = True) -> list[str]:
    """The CMAKE_ARGS for llama-cpp-python on a CPU with these flags, built by this compiler."""
    args = list(BASE_ARGS)
    args += [f"-D{option}={'ON' if on else 'OFF'}" for option, on in isa_options(flags).items()]
    amx, _ = amx_decision(flags, compiler, allow_amx)
    args += [f"-D{option}={'ON' if amx and all(f in flags for f in needs) else 'OFF'}"
             for option, needs in AMX_OPTIONS.items()]
    if amx:
        args += AMX_COMPILER_FLAGS
    return args


def expected_library_features(args: list[str]) -> set[str]:
    """The llama_print_system_info() features a library built with these args reports as 1."""
    on = {arg[2:].split("=")[0] for arg in args if arg.startswith("-DGGML_") and arg.endswith("=ON")}
    return {feature for option, feature in LIBRARY_FEATURE.items() if option in on}


def library_mismatch(library: dict[str, bool], flags: frozenset[str] | set[str],
                     compiler: tuple[str, int] = ("gcc", 12)) -> tuple[list[str], list[str]]:
    """(features this CPU has that the loaded library lacks, features the library uses that the CPU lacks).

    `library` is llama_print_system_info() parsed to {name: bool}. AMX counts as missing only where this
    module would build it (a clang build without AMX is a choice, reported by amx_decision).
    """
    wanted = expected_library_features(cmake_args(flags, compiler))
    have = {name for name, on in library.items() if on}
    missing = sorted(wanted - have)
    possible = expected_library_features(cmake_args(flags, ("gcc", 12)))
    unsupported = sorted((have & set(LIBRARY_FEATURE.values())) - possible)
    return missing, unsupported


def rebuild_command(args: list[str]) -> str:
    """The command that reinstalls llama-cpp-python with these args (pip's wheel cache bypassed)."""
    return (f'CMAKE_ARGS="{" ".join(args)}" pip install --force-reinstall --no-deps --no-cache-dir '
            "'llama-cpp-python==0.3.36'")


def main() -> int:
    """Print this CPU's CMAKE_ARGS on stdout and what was chosen, and why, on stderr."""
    flags = cpu_flags()
    compiler = compiler_family()
    allow = os.environ.get("SPECDEC_AMX", "1") != "0"
    args = cmake_args(flags, compiler, allow)
    chosen = [option.removeprefix("GGML_") for option, on in isa_options(flags).items() if on]
    _, why = amx_decision(flags, compiler, allow)
    if not flags:
        print("specdec: no /proc/cpuinfo flags: building llama.cpp with no x86 extensions", file=sys.stderr)
    print(f"specdec: llama.cpp for this CPU: {' '.join(chosen) or 'baseline'}; {why}", file=sys.stderr)
    print(" ".join(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
