"""The GPU bench's logic, run on the CPU with tiny dummy models: every method runs, outputs agree, the report is written."""

from __future__ import annotations

import json

import pytest

from specdec.cli.main import main

ALL = "plain,replay_k8,lookup_adaptive,draft_k4,draft_adaptive,hf_eager,hf_assisted_k4,hf_prompt_lookup"


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bench")
    code = main(["bench", "--load-format", "dummy", "--device", "cpu", "--dummy-target", "tiny", "--dummy-draft", "tiny",
                 "--num-prompts", "2", "--prompt-tokens", "40", "--max-tokens", "24", "--gpu-methods", ALL,
                 "--out", str(out)])
    assert code == 0
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_every_method_ran_and_agrees_with_plain(bench_run):
    results, _ = bench_run
    summary = results["summary"]["methods"]
    assert set(summary) == set(ALL.split(","))
    assert not results["skipped"]
    for name, row in summary.items():
        assert row["prompts"] == 2 and row["tokens"] == 48, name
        assert row["identical"] == 2, name  # dummy models have wide logit gaps: greedy never flips


def test_replay_is_the_ceiling_and_every_draft_is_accepted(bench_run):
    results, _ = bench_run
    replay = results["summary"]["methods"]["replay_k8"]
    assert replay["acceptance"] == 1.0
    assert replay["tokens_per_pass"] > 5  # 24 tokens in 3 passes of 9 rows (the last one cut by max_tokens)
    # The copy prompt holds the text the output repeats: prompt lookup finds it, so its adaptive policy is
    # asked (a policy per draft source that matched). Whether drafting it pays is that policy's call on the
    # measured pass costs of this CPU, a timing: `drafted > 0` failed in about 1 run of 7, before and after.
    assert results["policies"]["lookup_adaptive"]


def test_report_has_the_curves_and_labels(bench_run):
    results, markdown = bench_run
    assert set(results["curves"]) == {"target", "draft"}
    assert "Pass cost of the target" in markdown and "Dummy weights" in markdown
    assert results["summary"]["headline"]["cost_ratio_c_pass"] > 0
    assert results["summary"]["headline"]["limit_pass_ms"] is None  # no copy bandwidth measured off a GPU


def test_bad_gpu_flags_are_one_line_errors(capsys):
    assert main(["bench", "--load-format", "dummy", "--device", "cpu", "--gpu-methods", "plain,warp"]) == 2
    assert "--gpu-methods" in capsys.readouterr().err
    assert main(["bench", "--load-format", "dummy", "--device", "cpu", "--lookup-k-max", "99"]) == 2


def test_compiled_layers_are_timed_against_eager_layers(tmp_path):
    """--compile-layers on (the CUDA default, here on the CPU): the report holds both curves and the compile time."""
    code = main(["bench", "--load-format", "dummy", "--device", "cpu", "--dummy-target", "tiny", "--dummy-draft", "none",
                 "--num-prompts", "1", "--prompt-tokens", "20", "--max-tokens", "8", "--gpu-methods", "plain",
                 "--compile-layers", "on", "--out", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["curves_eager_layers"]["target"]) == {"1", "2", "4", "8", "16"}
    assert results["compile_seconds"]["target"] > 0
    assert "compiled layers" in results["runtime"]["target"]
    assert results["summary"]["headline"]["target_one_row_compiled_over_eager_layers"] > 0
    assert "eager layers (no torch.compile" in (tmp_path / "results.md").read_text()
