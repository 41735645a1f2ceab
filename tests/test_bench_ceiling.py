"""The bench's ceiling section: rows per emitted token, the perfect-drafter ceiling on the run's curve, and the
share of it each method reached, checked against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from markov_backend import MarkovBackend
from specdec.bench.method.ceiling import ceiling_markdown, ceiling_summary, rows_per_token

CURVE = {"1": 10.0, "2": 12.0, "4": 14.0, "8": 20.0}  # ms per pass of n rows


def _results(curve=CURVE):
    methods = [
        {"name": "plain", "kind": "specdec", "k": None},
        {"name": "suffix_adaptive", "kind": "specdec", "k": 4},
        {"name": "llamacpp_ngram", "kind": "llamacpp", "k": None},
    ]
    return {"config": {"methods": methods}, "pass_costs_ms": {"default": curve} if curve else {}}


def _scope(suffix_rate=20.0):
    return {
        # Two runs each: our engine counts decoding passes, and each run's prefill pass gave its first token.
        "plain": {"runs": 2, "generated_tokens": 60, "num_target_forwards": 58, "num_draft_tokens": 0,
                  "decode_tokens_per_second": 10.0},
        "suffix_adaptive": {"runs": 2, "generated_tokens": 60, "num_target_forwards": 18, "num_draft_tokens": 30,
                            "num_accepted_tokens": 40, "decode_tokens_per_second": suffix_rate, "cost_ratio": 0.0},
        "llamacpp_ngram": {"generated_tokens": 60, "num_target_forwards": 0, "num_draft_tokens": 40,
                           "num_accepted_tokens": 30, "decode_tokens_per_second": 15.0},
    }


def test_rows_per_token_counts_drafted_rows_and_one_per_pass():
    scope = _scope()
    assert rows_per_token(scope["plain"]) == 1.0
    assert rows_per_token(scope["suffix_adaptive"]) == pytest.approx(50 / 60, abs=1e-4)
    # llama-server reports no pass count: generated - accepted passes (each emits accepted + 1).
    assert rows_per_token(scope["llamacpp_ngram"]) == pytest.approx((40 + 30) / 60, abs=1e-4)


def test_ceiling_and_share_on_the_runs_curve():
    summary = ceiling_summary(_results(), _scope(), {"code_edit": _scope(25.0)})
    row = summary["overall"]["suffix_adaptive"]
    # k = 4: 5 rows cost 14 + (20 - 14) / 4 = 15.5 ms against 5 one-row passes (50 ms): 3.226x, the best k <= 4.
    assert row["ceiling_k"] == 4 and row["ceiling"] == pytest.approx(50 / 15.5, abs=1e-4)
    assert row["decode_speedup"] == pytest.approx(2.0)
    assert row["share_of_ceiling"] == pytest.approx(2.0 / (50 / 15.5), abs=1e-3)
    assert summary["per_task"]["code_edit"]["suffix_adaptive"]["decode_speedup"] == pytest.approx(2.5)
    assert "ceiling" not in summary["overall"]["plain"] and "ceiling" not in summary["overall"]["llamacpp_ngram"]
    text = "\n".join(ceiling_markdown(summary, ["code_edit"]))
    assert "| suffix_adaptive | 4 | 3.23x (4) | 0.83 | 2.00x | 62% | 78% |" in text
    assert "| ms | 10.0 | 12.0 | 14.0 | 20.0 |" in text


def test_a_flat_line_has_no_ceiling_and_a_run_without_a_curve_no_section():
    line = {str(n): 10.0 * n for n in (1, 2, 4, 8)}  # every row costs a pass: drafting cannot pay
    row = ceiling_summary(_results(line), _scope(), {})["overall"]["suffix_adaptive"]
    assert row["ceiling"] == 1.0 and row["ceiling_k"] == 0 and row["share_of_ceiling"] is None
    assert ceiling_summary(_results(None), _scope(), {}) is None


def test_the_run_records_the_curve_its_policies_read():
    from specdec.bench.method.probes import curve_ms

    calibrated, uncalibrated = MarkovBackend(torch.zeros(4, 4)), MarkovBackend(torch.zeros(4, 4))
    calibrated.pass_costs = {2: 0.012, 1: 0.01}
    assert curve_ms(calibrated) == {"1": 10.0, "2": 12.0}
    assert curve_ms(uncalibrated) is None


def test_copy_bound_per_task_from_the_runs_outputs_and_the_share_of_it_reached():
    results = _results()
    results["config"]["methods"][1]["spec"] = {"drafter": "suffix"}
    # code_edit: the answer (9 tokens) is the prompt: its 8 decoded tokens cost least in two passes of 4 rows
    # (2 x 14 ms; 5 + 3 rows would cost 15.5 + 13) against 8 x 10 ms. chat: nothing of its answer stands before it.
    results["outputs"] = {
        "code_edit/a": {"prompt_ids": list(range(9)), "plain_tokens": list(range(9))},
        "chat/b": {"prompt_ids": [50, 51], "plain_tokens": [60, 61, 62]},
    }
    summary = ceiling_summary(results, _scope(), {"code_edit": _scope(25.0), "chat": _scope(10.0)})
    edit = summary["per_task"]["code_edit"]["suffix_adaptive"]
    assert edit["copy_bound"] == pytest.approx(80 / 28, abs=1e-4)
    assert edit["copy_bound_share_of_ceiling"] == pytest.approx((80 / 28) / (50 / 15.5), abs=1e-4)
    assert edit["share_of_copy_bound"] == pytest.approx(2.5 / (80 / 28), abs=1e-3)
    chat = summary["per_task"]["chat"]["suffix_adaptive"]
    assert chat["copy_bound"] == 1.0 and "share_of_copy_bound" not in chat
    # Over all: total plain cost over total copy cost (80 + 20) / (28 + 20).
    assert summary["overall"]["suffix_adaptive"]["copy_bound"] == pytest.approx(100 / 48, abs=1e-4)
    assert "copy_bound" not in summary["overall"]["llamacpp_ngram"]  # not our copying drafter
    text = "\n".join(ceiling_markdown(summary, ["code_edit", "chat"]))
    assert "| suffix_adaptive | 2.08x (65%) / 96% | 2.86x (89%) / 88% | 1.00x (31%) / – |" in text


def test_a_later_prompt_copies_from_an_earlier_output_as_the_cross_request_cache_holds_it():
    results = _results()
    results["config"]["methods"][1]["spec"] = {"drafter": "suffix"}
    answer = list(range(100, 109))
    results["outputs"] = {"t/1": {"prompt_ids": [1], "plain_tokens": answer},
                          "t/2": {"prompt_ids": [2], "plain_tokens": answer}}
    summary = ceiling_summary(results, _scope(), {"t": _scope()})
    # The first answer is new (8 x 10 ms); the second repeats it: 2 passes of 4 rows (28 ms).
    assert summary["per_task"]["t"]["suffix_adaptive"]["copy_bound"] == pytest.approx(160 / 108, abs=1e-4)
