"""The default target's pass cost at every row count 1..33 (calibration.measure_pass_costs: rounds over every size,
alternating direction, warm-up 2, median of 3), twice, on llama.cpp's default (fast) kernels, 2 threads.
Usage: PYTHONPATH=src python full_curve.py"""
from specdec import load
from specdec.calibration import measure_pass_costs

decoder = load("default", draft=None, threads=2)
for _ in range(2):
    curve = measure_pass_costs(decoder.target, sizes=range(1, 34), repeats=3)
    print({n: round(1000 * s, 1) for n, s in curve.items()}, flush=True)
