"""Proofs, made in child processes and cached per library and CPU, that llama.cpp runs here: the library loads (no illegal instruction), AMX multi-row passes run and agree with the non-AMX kernels, and how many rows an AMX pass keeps bit-identical to one-row passes.

A library built natively for one CPU (a wheel from pip's cache, a home directory moved to another
machine) can die with SIGILL on another, and an AMX build made by a compiler that drops ggml's tile
configuration faults on the first pass of 2+ rows (native_build.py). Both would kill our process, so
each is tried first in a child process; the verdict is cached in llamacpp-probes.json in
$SPECDEC_MEASUREMENTS (default: the model cache) under the library's path, size and mtime and the CPU's
flags, so later runs pay nothing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from specdec.host.native_build import cmake_args, compiler_family, cpu_flags, rebuild_command
from specdec.host.paths import measurements_dir

PROBE_TIMEOUT = 300  # seconds; an AMX probe loads the model twice
AMX_PROBE_ROWS = 16  # enough rows that ggml takes the AMX tile kernels (not its one-row path)
# AMX quantizes activations like the other int8 kernels but accumulates in another order: logits differ a
# little. A wrong tile configuration gives garbage (or a fault), far outside this.
AMX_TOLERANCE = 0.05  # max |difference| / (max - min) of the reference logits, per row
# The longest verification exact mode makes (adaptive k up to 32, plus the bonus row): the AMX
# row-invariance probe tries every pass length up to it.
EXACT_PROBE_MAX_ROWS = 33


class LibraryProbeError(RuntimeError):
    """The llama.cpp library cannot run on this CPU (the message says how to rebuild it)."""


def library_file() -> Path | None:
    """The libllama llama-cpp-python will load, found without importing it (None if not installed)."""
    base = os.environ.get("LLAMA_CPP_LIB_PATH")
    if base is None:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or not spec.submodule_search_locations:
            return None
        base = str(Path(next(iter(spec.submodule_search_locations))) / "lib")
    for name in ("libllama.so", "libllama.dylib", "llama.dll"):
        if (Path(base) / name).is_file():
            return Path(base) / name
    return None


def fingerprint(path: Path) -> str:
    """Path, size and modification time: what changes when a library or model file is replaced."""
    stat = path.stat()
    return f"{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"


def _cache_file() -> Path:
    return measurements_dir() / "llamacpp-probes.json"


def _cached(key: str, compute) -> dict:
    """compute() once per key, remembered on disk (a corrupt or unwritable cache only costs a new probe)."""
    path = _cache_file()
    try:
        verdicts = json.loads(path.read_text())
    except (OSError, ValueError):
        verdicts = {}
    if key in verdicts:
        return verdicts[key]
    verdict = compute()
    verdicts[key] = verdict
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(verdicts, indent=1))
        tmp.replace(path)
    except OSError:
        pass
    return verdict


def _run_child(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPECDEC_LLAMACPP_PROBED="1")
    result = subprocess.run([sys.executable, "-m", "specdec.backends.llamacpp.probe_child", *args], capture_output=True,
                            text=True, timeout=PROBE_TIMEOUT, env=env)
    if result.returncode == -signal.SIGINT:
        # Ctrl-C reaches the child too (one process group): that says nothing about the library, and a
        # verdict made of it would be cached for good. Stop as the user asked.
        raise KeyboardInterrupt
    return result


def _died(result: subprocess.CompletedProcess) -> str:
    if result.returncode < 0:
        try:
            return signal.Signals(-result.returncode).name
        except ValueError:
            return f"signal {-result.returncode}"
    return f"exit status {result.returncode}: {result.stderr.strip().splitlines()[-1:] or ''}"


def check_library_runs() -> None:
    """Raise LibraryProbeError if loading this libllama in a child process dies (wrong CPU); cached."""
    if os.environ.get("SPECDEC_LLAMACPP_PROBED") == "1":
        return  # we are the child
    library = library_file()
    if library is None:
        return  # the import will fail with its own message
    flags = cpu_flags()
    key = "load:" + fingerprint(library) + ":" + hashlib.sha1(" ".join(sorted(flags)).encode()).hexdigest()[:16]

    def probe() -> dict:
        try:
            result = _run_child(["load"])
        except subprocess.TimeoutExpired:
            return {"ok": False, "why": f"loading it took over {PROBE_TIMEOUT} s"}
        # Only a death by signal (SIGILL: another CPU's instructions) condemns the library; any other failure
        # (say, specdec not importable in a child) is left to the import in this process to report.
        return {"ok": result.returncode >= 0, "why": "" if result.returncode >= 0 else _died(result)}

    verdict = _cached(key, probe)
    if not verdict["ok"]:
        raise LibraryProbeError(
            f"the llama.cpp library {library} does not run on this CPU ({verdict['why']}): it was built for "
            f"another machine. Rebuild it for this one: {rebuild_command(cmake_args(flags, compiler_family()))}"
        )


def amx_rows_agree(gguf_path: str | os.PathLike, threads: int = 1) -> dict:
    """{"ok": bool | None, "why": str, "max_error": float}: does a multi-row pass with AMX weights run and match?
    None where the child could not load the model at all (not a verdict on AMX). Cached."""
    return _model_probe("amx", "amx", gguf_path, threads, lambda what: {
        "ok": False, "why": f"a {AMX_PROBE_ROWS}-row pass with AMX weights {what}", "max_error": None})


def amx_invariant_rows(gguf_path: str | os.PathLike, threads: int = 1) -> dict:
    """{"rows": n, "why": str}: with AMX weights and exact mode's other settings, every pass of 2..n rows
    (n <= EXACT_PROBE_MAX_ROWS) gave each row bit-identical to decoding it alone. Measured on this model
    in a child process (AMX could fault), cached; rows 1 when nothing longer held or the probe failed.

    AMX multiplies int8 activations by int8 weights with int32 sums, so on a model whose weights all
    take AMX the result is the same whatever the row count (the default 1.5B target: every length
    to 64); a model with tensors AMX does not take falls back to kernels that switch at 4 or 8 rows."""
    return _model_probe(f"amx-rows:{threads}", "amxrows", gguf_path, threads, lambda what: {
        "rows": 1, "why": f"the AMX row-invariance probe {what}"})


def _model_probe(kind: str, command: str, gguf_path: str | os.PathLike, threads: int,
                 failed: Callable[[str], dict]) -> dict:
    """The child's verdict (`python -m specdec.backends.llamacpp.probe_child COMMAND GGUF THREADS`, its last stdout line as JSON), cached per
    kind, library and model file; failed("took over ... s" / "died (...)") where it timed out or died."""
    library = library_file()
    gguf = Path(gguf_path)
    key = f"{kind}:" + (fingerprint(library) if library else "?") + ":" + fingerprint(gguf)

    def probe() -> dict:
        try:
            result = _run_child([command, str(gguf), str(threads)])
        except subprocess.TimeoutExpired:
            return failed(f"took over {PROBE_TIMEOUT} s")
        if result.returncode != 0:
            return failed(f"died ({_died(result)})")
        return json.loads(result.stdout.strip().splitlines()[-1])

    return _cached(key, probe)
