"""What `specdec generate` prints: no speedup or acceptance from a run that drafted nothing, and where greedy outputs part."""

from __future__ import annotations

import torch

from specdec.backends.base import ModelBackend
from specdec.cli.generation_report import first_divergence, format_generation_report


def report(drafted: int, identical: bool = True) -> dict:
    stats = {"num_generated_tokens": 10, "num_draft_tokens": drafted, "acceptance_rate": 0.5 if drafted else 0.0,
             "mean_acceptance_length": 1.5, "acceptance_rate_per_pos": [0.5] if drafted else [],
             "tokens_per_second": 10.9, "num_target_forwards": 8}
    out = {"prompt_tokens": 5, "finish_reason": "length", "stats": stats,
           "spec": {"drafter": "draft_model", "k": 5, "k_policy": "adaptive"},
           "plain": {"tokens_per_second": 10.0}, "speedup": 1.09, "cost_ratio": 0.4, "leviathan_bound": 1.2,
           "verify_cost": 1.6, "cost_model_bound": 1.01, "identical_to_plain": identical,
           "runtime": "llama.cpp AVX2; repacked weights; fast"}
    if not identical:
        out["divergence"] = {"token_index": 7, "plain_token": 11, "speculative_token": 12, "logit_gap": 0.0123}
    return out


def test_a_run_that_drafted_prints_its_speedup_and_bounds():
    text = format_generation_report(report(drafted=8))
    assert "speedup              1.09x" in text and "Leviathan bound" in text and "acceptance rate      0.500" in text
    # Under adaptive k some passes verify no draft: tokens per pass (10 / 8) is not the accept length (1.5).
    assert "mean accept. length  1.50  (tokens per pass that verified a draft" in text
    assert "tokens per pass      1.25" in text


def test_a_run_without_drafts_prints_no_speedup_acceptance_or_bound():
    text = format_generation_report(report(drafted=0))
    assert "drafts               none" in text and "drafting does not pay" in text
    assert "1.09x" not in text and "Leviathan" not in text and "acceptance rate" not in text
    assert "timing noise" in text and "10.00 tokens/s" in text  # both rates stay, labelled


def test_where_greedy_outputs_part_is_printed():
    text = format_generation_report(report(drafted=8, identical=False))
    assert "NO: from generated token 7" in text and "0.0123" in text and "--exact" in text
    assert "runtime              llama.cpp AVX2" in text
    out = report(drafted=8)
    out["spec"]["why"] = "the default without a draft model (model-free)"
    assert "(adaptive); the default without a draft model (model-free)" in format_generation_report(out)


def test_the_speedup_comes_with_its_interval_and_a_verdict():
    out = report(drafted=8)
    assert "one pair of runs: no estimate of its noise" in format_generation_report(out)
    out["speedup_interval"] = {"estimate": 1.09, "low": 0.97, "high": 1.22, "pairs": 3, "confidence": 0.95}
    text = format_generation_report(out)
    assert "1.09x  [0.97, 1.22] (95% interval, 3 interleaved pairs of runs): within noise of plain decoding" in text
    out["speedup_interval"] = {"estimate": 1.2, "low": 1.1, "high": 1.3, "pairs": 3, "confidence": 0.95}
    assert "faster than plain decoding" in format_generation_report(out)
    out["speedup_interval"] = {"estimate": 0.8, "low": 0.7, "high": 0.9, "pairs": 3, "confidence": 0.95}
    assert "slower than plain decoding" in format_generation_report(out)


def test_generate_pairs_its_runs_in_alternating_order(monkeypatch):
    """Three repeats: the first speculative run, then plain; then pairs P S and S P (drift hits both alike)."""
    from specdec.cli import generation_report as report_module

    calls = []

    class Engine:
        def __init__(self, name, rate):
            self.name, self.rate = name, rate

        drafter = None

        def generate(self, prompt, params):
            calls.append(self.name)

            class Stats:
                tokens_per_second = self.rate
            return type("Result", (), {"stats": Stats})()

    class Decoder:
        def plain_engine(self):
            return Engine("plain", 10.0)

        def engine(self, spec):
            return Engine("spec", 12.0)

    ratios = report_module._more_pairs(Decoder(), [1, 2], None, None, 2)
    assert calls == ["plain", "spec", "spec", "plain"] and ratios == [1.2, 1.2]


def test_a_stale_cached_curve_prints_no_ceiling():
    out = report(drafted=8)
    out["ceiling_stale"] = {"curve_one_row_ms": 128.0, "measured_one_row_ms": 36.5}
    text = format_generation_report(out)
    assert "ceiling here         not shown" in text and "128 ms" in text and "36.5 ms" in text
    assert "if every drafted token were accepted" not in text


def test_the_machines_ceiling_is_printed_from_the_measured_curve():
    out = report(drafted=8)
    out["ceiling"] = {"speedup": 1.449, "k": 3, "draft_cost_ratio": 0.0,
                      "pass_ms": {1: 35.8, 2: 59.8, 3: 77.1, 4: 98.8}}
    text = format_generation_report(out)
    assert "ceiling here         1.45x at k=3 if every drafted token were accepted" in text
    assert "1/2/3/4 rows: 35.8/59.8/77.1/98.8 ms" in text
    out["ceiling"] = {"speedup": 1.0, "k": 0, "draft_cost_ratio": 0.5, "pass_ms": {1: 35.0, 2: 70.0}}
    text = format_generation_report(out)
    assert "cannot beat plain decoding here" in text and "c = 0.50" in text


class _Target(ModelBackend):
    """Logits that favour token 11 over 12 by 0.25 after any context."""

    max_context = 64

    def new_cache(self, capacity):
        class Cache:
            length = 0

            def trim(self, n):
                self.length -= n
        return Cache()

    def forward(self, tokens, cache, num_logits=1):
        cache.length += len(tokens)
        row = torch.zeros(1, 20)
        row[0, 11], row[0, 12] = 1.0, 0.75
        return row


def test_first_divergence_finds_the_token_and_the_gap():
    decoder = type("D", (), {"target": _Target()})()
    where = first_divergence(decoder, [1, 2], [3, 4, 11, 5], [3, 4, 12, 6])
    assert where == {"token_index": 2, "plain_token": 11, "speculative_token": 12, "logit_gap": 0.25}
    # One output a prefix of the other (ended differently): the index, no gap.
    assert first_divergence(decoder, [1], [3, 4], [3, 4, 9])["token_index"] == 2


