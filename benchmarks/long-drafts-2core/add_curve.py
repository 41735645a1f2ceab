"""Add the pass-cost curve the adaptive policies read to a finished bench run that predates results.pass_costs_ms,
and re-render its markdown with the cost-curve-and-ceiling section.

The curve is not measured again: it is the entry of $SPECDEC_CACHE/pass-costs.json under the target's calibration
key (this CPU, the library, the model file, kernels, mode, threads), which the engine read in the run because a
cached curve is only measured once. Loading the target here only computes that key.

    python benchmarks/long-drafts-2core/add_curve.py benchmarks/long-drafts-2core            # both thread counts
    python benchmarks/long-drafts-2core/add_curve.py benchmarks/long-drafts-2core/code-k-sweep  # one run
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specdec.backends.llamacpp_backend import LlamaCppBackend
from specdec.bench.report import summarise, write_results, write_results_by_threads
from specdec.calibration import _calibration_key, _read_curves


def curve_ms(gguf: str, threads: int, batch_invariant: bool) -> dict[str, float]:
    backend = LlamaCppBackend(gguf, max_context=512, threads=threads, batch_invariant=batch_invariant)
    try:
        stored = _read_curves().get(_calibration_key(backend))
    finally:
        backend.close()
    if not stored:
        raise SystemExit(f"no cached curve for {gguf} at {threads} threads")
    return {rows: round(seconds * 1000, 3) for rows, seconds in sorted(stored.items(), key=lambda kv: int(kv[0]))}


def main(out_dir: str) -> None:
    root = Path(out_dir)
    if not (root / "threads.json").exists():  # one thread count: results.json in the folder itself
        write_results(with_curve(json.loads((root / "results.json").read_text())), root, plot=True)
        return
    index = json.loads((root / "threads.json").read_text())
    by_threads = {}
    for threads in index["thread_counts"]:
        path = root / index["results"][str(threads)]
        results = json.loads(path.read_text())
        by_threads[threads] = with_curve(results)
    write_results_by_threads(by_threads, root, plot=True)


def with_curve(results: dict) -> dict:
    target = results["environment"]["target"]
    results["pass_costs_ms"] = {"default": curve_ms(target["gguf"], int(target["threads"]), target["batch_invariant"])}
    results["summary"] = summarise(results)
    return results


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/long-drafts-2core")
