"""The child-process proofs that llama.cpp runs here: a library that dies on load is refused with the rebuild command, verdicts are cached, and a failed AMX check turns llama.cpp's extra buffers off instead of crashing."""

from __future__ import annotations

import subprocess
import warnings

import pytest

from specdec.backends.llamacpp import probe as llamacpp_probe
from specdec.backends.llamacpp.probe import (
    LibraryProbeError,
    amx_invariant_rows,
    amx_rows_agree,
    check_library_runs,
)


@pytest.fixture()
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_MEASUREMENTS", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDEC_LLAMACPP_PROBED", raising=False)
    library = tmp_path / "libllama.so"
    library.write_bytes(b"\0" * 16)
    monkeypatch.setattr(llamacpp_probe, "library_file", lambda: library)
    calls = []

    def child(returncode, stdout=""):
        def run(args):
            calls.append(args)
            return subprocess.CompletedProcess(args, returncode, stdout, "")
        monkeypatch.setattr(llamacpp_probe, "_run_child", run)

    return child, calls, tmp_path


def test_a_library_that_dies_on_load_is_refused_with_the_rebuild_command(isolated):
    child, calls, _ = isolated
    child(-4)  # SIGILL: built for another CPU
    with pytest.raises(LibraryProbeError, match="SIGILL") as error:
        check_library_runs()
    assert "CMAKE_ARGS=" in str(error.value) and "--no-cache-dir" in str(error.value)
    # The verdict is cached: no second child for the same library and CPU.
    with pytest.raises(LibraryProbeError):
        check_library_runs()
    assert len(calls) == 1


def test_a_library_that_loads_is_probed_once(isolated):
    child, calls, tmp_path = isolated
    child(0, "CPU : AVX2 = 1 |")
    check_library_runs()
    check_library_runs()
    assert calls == [["load"]]
    # Negative control: a rebuilt library (new size and mtime) is probed again.
    (tmp_path / "libllama.so").write_bytes(b"\0" * 32)
    check_library_runs()
    assert len(calls) == 2


def test_a_child_that_fails_without_a_signal_does_not_condemn_the_library(isolated):
    child, calls, _ = isolated
    child(1)  # e.g. specdec not importable in the child: the import in this process reports what is wrong
    check_library_runs()
    assert len(calls) == 1


def test_a_model_the_child_cannot_load_is_no_verdict_on_amx(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("SPECDEC_MEASUREMENTS", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    verdict = amx_rows_agree(broken, threads=1)
    assert verdict["ok"] is None and "did not load" in verdict["why"]
    assert amx_invariant_rows(broken, threads=1)["rows"] == 1


def test_the_amx_check_reports_a_dying_pass_and_caches_it(isolated):
    child, calls, tmp_path = isolated
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    child(-11)  # the tile config fault
    verdict = amx_rows_agree(model, threads=2)
    assert verdict["ok"] is False and "died" in verdict["why"] and "SIGSEGV" in verdict["why"]
    assert amx_rows_agree(model, threads=2) == verdict and len(calls) == 1
    child(0, '{"ok": true, "why": "", "max_error": 0.01}')
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF2")
    assert amx_rows_agree(other)["ok"] is True


def test_a_failed_amx_check_turns_extra_buffers_off_instead_of_crashing(monkeypatch, tmp_path):
    from specdec.backends.llamacpp import backend as llamacpp_backend
    from tiny_gguf import write_tiny_gguf

    real = llamacpp_backend.build_features()
    monkeypatch.setattr(llamacpp_backend, "build_features", lambda: {**real, "AMX_INT8": True})
    monkeypatch.setattr(llamacpp_backend, "amx_rows_agree",
                        lambda path, threads=1: {"ok": False, "why": "a 16-row pass died", "max_error": None})
    path = write_tiny_gguf(tmp_path / "t.gguf", seed=0, layers=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = llamacpp_backend.LlamaCppBackend(path, max_context=64, threads=1, batch_invariant=False)
    assert fast.extra_buffers is False and fast.amx is False and fast.amx_check["ok"] is False
    assert any("AMX is off" in str(w.message) for w in caught)
    # Exact mode on an AMX library never uses AMX's buffers (not row-invariant) and slices by 7.
    exact = llamacpp_backend.LlamaCppBackend(path, max_context=64, threads=1, batch_invariant=True)
    assert exact.extra_buffers is False and exact.invariant_rows == llamacpp_backend.INVARIANT_ROWS
    # Negative control: the check passing keeps them on.
    monkeypatch.setattr(llamacpp_backend, "amx_rows_agree", lambda path, threads=1: {"ok": True, "why": "", "max_error": 0})
    assert llamacpp_backend.LlamaCppBackend(path, max_context=64, threads=1, batch_invariant=False).extra_buffers


def test_ctrl_c_during_a_probe_stops_and_condemns_nothing(tmp_path, monkeypatch):
    """Ctrl-C reaches the probing child too (SIGINT to the process group): that is the user stopping, not a
    library that cannot run, and no verdict is cached from it."""
    monkeypatch.setenv("SPECDEC_MEASUREMENTS", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDEC_LLAMACPP_PROBED", raising=False)
    library = tmp_path / "libllama.so"
    library.write_bytes(b"\0" * 16)
    monkeypatch.setattr(llamacpp_probe, "library_file", lambda: library)
    returncodes = [-2, 0]  # the child killed by SIGINT, then a child that loads
    monkeypatch.setattr(llamacpp_probe.subprocess, "run",
                        lambda args, **kwargs: subprocess.CompletedProcess(args, returncodes.pop(0), "", ""))
    with pytest.raises(KeyboardInterrupt):
        check_library_runs()
    check_library_runs()  # probed again (nothing cached), and this time it loads
    assert returncodes == []
