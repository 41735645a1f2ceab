"""The FIM bench: its seeded sample, the sandboxed unit-test scoring (canonical passes, wrong fails, a hang is cut),
the editor trace's plan, the summary's arithmetic, and one end-to-end run on a tiny FIM GGUF."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from specdec.bench.fim.problems import load_problems, sample_problems
from specdec.bench.fim.report import paired, summarise
from specdec.bench.fim.run import TraceOptions, trace_requests
from specdec.bench.fim.scoring import exact_match, passes

TESTS_DIR = Path(__file__).resolve().parent


def test_the_sample_is_fixed_by_its_seed_and_takes_one_gap_per_problem():
    first, again = sample_problems("multi", 10, seed=43), sample_problems("multi", 10, seed=43)
    assert [p.task_id for p in first] == [p.task_id for p in again]
    assert len({p.humaneval_id for p in first}) == 10
    assert [p.task_id for p in sample_problems("multi", 10, seed=44)] != [p.task_id for p in first]
    assert len(load_problems("single")) == 1033 and len(load_problems("multi")) == 5815
    with pytest.raises(ValueError, match="unknown infilling set"):
        load_problems("triple")


def test_scoring_runs_the_unit_test_on_the_completed_program():
    problem = sample_problems("single", 1, seed=1)[0]
    assert passes(problem, problem.solution) and exact_match(problem, problem.solution + "  \n")
    assert not passes(problem, "    raise SystemExit(3)\n")
    began = time.monotonic()
    assert not passes(problem, "    while True:\n        pass\n", timeout=2.0)
    assert time.monotonic() - began < 6
    assert not exact_match(problem, "    pass\n")


def test_the_trace_types_into_each_file_and_cancels_every_third_request():
    problems = sample_problems("multi", 3, seed=43)
    plan = trace_requests(problems, TraceOptions(files=2, steps=3, stride=5, cancel_every=3))
    assert len(plan) == 6 and [c for *_, c in plan] == [False, False, True, False, False, True]
    item, prefix, suffix, _ = plan[1]
    assert prefix == problems[0].prefix + problems[0].solution[:5] and suffix == problems[0].suffix


def _record(system, item, e2e, tok_s, passed, content="x", set_name="multi"):
    return {"system": system, "item": item, "set": set_name, "e2e": e2e, "ttft": 0.1, "tokens": 10,
            "decode_tokens_per_second": tok_s, "passed": passed, "exact_match": False, "content": content,
            "error": None}


def test_paired_ratios_and_identity():
    ours = {str(i): _record("ours", str(i), 1.0, 20.0, True) for i in range(4)}
    peer = {str(i): _record("llamacpp_plain", str(i), 2.0, 10.0, i < 3) for i in range(4)}
    found = paired(ours, peer)
    assert found["decode_speedup"]["estimate"] == pytest.approx(2.0) and found["e2e_median_ratio"] == 0.5
    assert found["pass_difference"] == 1
    records = [*ours.values(), *peer.values(), *(_record("reference", str(i), 1.0, 10.0, True, "y")
                                                 for i in range(4))]
    summary = summarise({"records": records, "trace": None})["sets"]["multi"]
    assert summary["identity"]["ours"] == {"problems": 4, "same_verdict": 4, "same_text": 0, "verdict_differs": []}
    assert summary["systems"]["llamacpp_plain"]["passed"] == 3


def test_fim_bench_end_to_end_on_a_tiny_gguf(tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("httpx")
    sys.path.insert(0, str(TESTS_DIR))
    from specdec.cli import main as cli
    from tiny_gguf import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "fim.gguf", seed=0, fim=True, context=4096)
    out = tmp_path / "out"
    code = cli.main(["bench", "--fim", str(model), "--fim-sample", "1", "--fim-systems", "reference,ours,ours_exact",
                     "--fim-trace-files", "1", "--threads", "1", "--request-timeout", "120", "--out", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    sets = results["summary"]["sets"]
    assert set(sets) == {"single", "multi"}
    for entry in sets.values():
        assert entry["identity"]["ours_exact"]["same_text"] == 1  # --exact equals plain decoding
        assert all(row["errors"] == 0 for row in entry["systems"].values())
    trace = results["summary"]["trace"]
    ours, cold = trace["systems"]["ours"], trace["systems"]["ours_cold"]
    assert ours["requests"] == cold["requests"] == 6 and ours["completed"] + ours["cancelled"] == 6
    assert ours["cached_fraction_mean"] > 0.5 and cold["cached_fraction_mean"] == 0  # keystrokes reuse the file
    assert trace["ours_running_after"] == 0 and trace["rss_after"]["ours"] > 0
    assert results["environment"]["lscpu"] and (out / "results.md").read_text().startswith("# specdec bench --fim")
