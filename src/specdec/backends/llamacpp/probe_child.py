"""The child-process side of probe.py: load the library, or run one probe on a model, and print the verdict as JSON.
Run as `python -m specdec.backends.llamacpp.probe_child load | amx GGUF THREADS | amxrows GGUF THREADS`; a fault
here (SIGILL, a bad AMX tile configuration) kills only this process."""

from __future__ import annotations

import json
import sys

import numpy as np

from specdec.backends.llamacpp.backend import LlamaCppBackend
from specdec.backends.llamacpp.probe import AMX_PROBE_ROWS, AMX_TOLERANCE, EXACT_PROBE_MAX_ROWS


def amx_rows_verdict(gguf: str, threads: int) -> dict:
    """In the child: the longest run of pass lengths 2, 3, ... whose rows all equal one-row passes bit for bit."""
    try:
        backend = LlamaCppBackend(gguf, max_context=256, threads=threads, batch_invariant=True,
                                  extra_buffers=True, check_amx=False)
    except (OSError, ValueError) as exc:
        return {"rows": 1, "why": f"the model did not load: {exc}"}
    vocab = min(1000, backend.vocab_size)
    prefix = [(i * 37 + 5) % vocab for i in range(24)]
    rows = [(i * 53 + 11) % vocab for i in range(EXACT_PROBE_MAX_ROWS)]
    cache = backend.new_cache()
    backend.forward(prefix, cache)
    alone = [backend.forward([token], cache)[0].numpy() for token in rows]
    invariant = 1
    for n in range(2, EXACT_PROBE_MAX_ROWS + 1):
        cache.trim(cache.length - len(prefix))
        # One llama_decode of n rows, not forward's slices: the kernels a pass of n rows would take.
        together = backend.decode_together(rows[:n], cache)
        if any(not (together[i] == alone[i]).all() for i in range(n)):
            break
        invariant = n
    backend.close()
    why = "" if invariant == EXACT_PROBE_MAX_ROWS else f"a pass of {invariant + 1} rows changed a row's logits"
    return {"rows": invariant, "why": why}


def amx_agreement_verdict(gguf: str, threads: int) -> dict:
    """In the child: logits of one multi-row pass with extra buffer types (AMX) and without, compared."""
    rows = []
    for extra in (True, False):
        try:
            backend = LlamaCppBackend(gguf, max_context=256, threads=threads, batch_invariant=False,
                                      extra_buffers=extra, check_amx=False)
        except (OSError, ValueError) as exc:
            # Not a verdict on AMX: the caller's own load of the file reports what is wrong with it.
            return {"ok": None, "why": f"the model did not load: {exc}", "max_error": None}
        # Ids inside the model's vocabulary (a tiny test model has a few hundred): an id past it is a
        # refused batch (llama_decode -1), not a verdict on AMX.
        tokens = [(i * 131 + 17) % min(1000, backend.vocab_size) for i in range(AMX_PROBE_ROWS)]
        cache = backend.new_cache()
        rows.append(backend.forward(tokens, cache, num_logits=len(tokens)).numpy())
        backend.close()
    got, reference = rows
    span = np.maximum(reference.max(axis=1) - reference.min(axis=1), 1e-6)
    error = float((np.abs(got - reference).max(axis=1) / span).max())
    ok = bool(np.isfinite(got).all()) and error <= AMX_TOLERANCE
    why = "" if ok else f"its logits differ from the non-AMX kernels' by {error:.3f} of their range"
    return {"ok": ok, "why": why, "max_error": round(error, 5)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["load"]:
        import llama_cpp  # the llamacpp extra: its load is what this child proves survivable

        llama_cpp.llama_backend_init()
        print(llama_cpp.llama_print_system_info().decode("utf-8", "replace"))
        return 0
    if argv[:1] == ["amx"] and len(argv) == 3:
        print(json.dumps(amx_agreement_verdict(argv[1], int(argv[2]))))
        return 0
    if argv[:1] == ["amxrows"] and len(argv) == 3:
        print(json.dumps(amx_rows_verdict(argv[1], int(argv[2]))))
        return 0
    print("usage: python -m specdec.backends.llamacpp.probe_child load | amx GGUF THREADS | amxrows GGUF THREADS",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
