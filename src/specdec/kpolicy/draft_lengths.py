"""This step's draft length per decoding sequence, priced at what its rows add to the step's one target pass."""

from __future__ import annotations

from collections.abc import Sequence

from specdec.kpolicy.base import KPolicy
from specdec.kpolicy.row_allocation import Candidate, allocate_rows


def choose_draft_lengths(options: Sequence[tuple[KPolicy | None, int]], prefill_rows: int) -> list[int]:
    """k per (policy, most it may draft) in order; None: a plain step (k 0), its one row still in the pass.

    In a shared pass (prefill rows or several sequences), the sequences whose policies are allocatable (they learn
    acceptance from plans) have their lengths chosen together (row_allocation: the pass's tokens per second on the
    measured curve, which one sequence at a time cannot see where the curve is not convex). The others choose
    alone, in order, each seeing the rows the rest put in the pass (prefill, the drafts chosen so far, one row per
    sequence still to choose) and the tokens the others are expected to emit.
    """
    shared = prefill_rows + len(options) > 1
    together = [shared and cap > 0 and policy is not None and policy.allocatable for policy, cap in options]
    ks: list[int] = [0] * len(options)
    rows, tokens = prefill_rows + sum(together), float(len(options))
    alone = [i for i, joint in enumerate(together) if not joint]
    for n, i in enumerate(alone):
        policy, cap = options[i]
        if policy is None:
            rows += 1
            continue
        policy.set_pass_context(rows + len(alone) - n - 1, float(len(options) - 1))
        ks[i] = min(policy.next_k(), cap)
        rows += 1 + max(ks[i], 0)
        if ks[i] > 0:
            tokens += policy.expected_tokens(ks[i]) - 1.0
    joint = [i for i, flag in enumerate(together) if flag]
    if joint:
        curve = options[joint[0]][0].shared_pass_curve()
        candidates = [Candidate(options[i][0].position_gains(options[i][1]), options[i][0].draft_cost)
                      for i in joint]
        margin = options[joint[0]][0].margin  # every allocatable policy learns from plans: PLAN_MARGIN
        ks_joint = allocate_rows(candidates, rows, tokens, curve, margin)
        for i, k in zip(joint, ks_joint):
            ks[i] = options[i][0].take_k(k)
    return ks
