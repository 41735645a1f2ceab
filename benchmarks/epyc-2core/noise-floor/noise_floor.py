"""The noise floor (bench/paired.py: noise_floor) of the EPYC's four method-bench runs, from their results.json:
our plain decoding and llama-server plain produce the same greedy tokens on the same kernels, so their paired
ratio per prompt is an A/A comparison. Reads files only (no timing).
Usage: PYTHONPATH=src python benchmarks/epyc-2core/noise-floor/noise_floor.py"""
import json
from pathlib import Path

from specdec.bench.paired import noise_floor, noise_floor_markdown

here = Path(__file__).resolve().parent.parent
for run in ("issue20-threads-2", "issue20-threads-1", "session17-threads-2", "session17-threads-1"):
    results = json.loads((here / run / "results.json").read_text())
    tasks = list(dict.fromkeys(r["task"] for r in results["runs"]))
    print(f"{run}: {noise_floor_markdown(noise_floor(results['runs'], 'llamacpp_plain', tasks))[0]}")
