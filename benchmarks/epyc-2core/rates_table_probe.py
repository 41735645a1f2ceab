"""Probe: what the adaptive policy's rate table costs per call (the policy prices every k each step), computed k by
k through verify_cost (the code before the cost table) against the one-pass table; alone and beside 7 other rows,
k up to 32, the default target's curve as measured on the 2-vCPU EPYC. Pure Python, one thread.

    PYTHONPATH=src python benchmarks/epyc-2core/rates_table_probe.py
"""
import time
from types import SimpleNamespace

from specdec.adaptive import AdaptiveK

CURVE = {1: 0.0363, 2: 0.0579, 3: 0.0738, 4: 0.0903, 5: 0.1135, 8: 0.2156, 9: 0.2305, 16: 0.2762, 17: 0.3111,
         32: 0.4935, 33: 0.4924}


def k_by_k(policy):
    """The rate table as computed before: each k's verify_cost on its own (level, shared curve, sort each time)."""
    rates = policy.acceptance_per_pos()
    level = policy._curve_level()
    shared = policy.other_tokens if policy.other_rows > 0 else 0.0
    out, expected, survive = [], 1.0, 1.0
    for k in range(policy.max_k + 1):
        if k:
            survive *= rates[k - 1]
            expected += survive
        out.append((shared + expected) / (k * policy.draft_cost + policy.verify_cost(k + 1, level)))
    return out


for other_rows in (0, 7):
    policy = AdaptiveK(max_k=32, pass_costs=CURVE)
    for size, seconds in ((1, 0.036), (4, 0.092)):
        policy.update(size - 1, size - 1, 1e-4 * (size - 1), seconds)
    policy.other_rows, policy.other_tokens = other_rows, float(other_rows)
    policy.shared_pass_costs = {8: SimpleNamespace(value=0.25, count=3)} if other_rows else {}
    assert max(abs(a - b) / b for a, b in zip(policy._rates(), k_by_k(policy))) < 1e-12
    for rnd in range(3):
        for name, fn in (("k by k", k_by_k), ("table", AdaptiveK._rates)):
            began = time.perf_counter()
            for _ in range(2000):
                fn(policy)
            print(f"other rows {other_rows}, round {rnd}: {name:6s} {(time.perf_counter() - began) / 2000 * 1e6:6.1f} us per table",
                  flush=True)
