"""The chat bench: Spec-Bench prompts (format, bundled set, per-category limit), --threads lists, prefill and
decode rates, and the per-category table relative to llama.cpp's plain decoding (math on synthetic runs)."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.bench.datasets import (
    BenchPrompt,
    DatasetError,
    limit_per_task,
    load_prompt_file,
    load_tasks,
    select_prompts,
    spec_bench_path,
)
from specdec.bench.method.aggregate import summarise
from specdec.bench.method.methods import MethodOptions, resolve_methods
from specdec.bench.method.render import category_table, to_markdown, to_markdown_by_threads
from specdec.bench.method.speed_and_length import speed_and_length
from specdec.cli.flags import parse_thread_list
from specdec.cli.main import main
from specdec.config import ConfigError
from specdec.decoder import SpecDecoder

SPEC_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                         "humanities", "translation", "summarization", "qa", "math_reasoning", "rag")
NO_FORWARDS = {"calls": 0, "seconds": 0.0, "tokens": 0, "short_calls": 0, "short_seconds": 0.0}


def _write_lines(path, *records) -> str:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


# -- Spec-Bench's format ---------------------------------------------------------------------------------

def test_spec_bench_lines_give_the_first_turn_with_the_category_as_task(tmp_path):
    path = _write_lines(
        tmp_path / "q.jsonl",
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now make it rhyme."]},
        "",
        {"question_id": "tr-1", "category": "translation", "turns": ["Translate: Guten Tag"],
         "reference": ["x"]},
        {"prompt": "a plain prompt", "id": "p1"},
        "\"a bare string\"",
        {"question": "kept as the plain format", "category": "ignored"},
    )
    prompts = load_prompt_file(path)
    assert [(p.task, p.id, p.text) for p in prompts] == [
        ("writing", "81", "Write a poem."),  # the first turn only: single-turn runs
        ("translation", "tr-1", "Translate: Guten Tag"),
        ("prompts", "p1", "a plain prompt"),
        ("prompts", "5", "a bare string"),
        ("prompts", "6", "kept as the plain format"),
    ]
    assert prompts[0].completion_text == "Write a poem."


@pytest.mark.parametrize(
    "record, message",
    [
        ({"question_id": 1, "turns": ["hi"]}, "missing 'category'"),
        ({"question_id": 1, "category": "qa"}, "missing 'turns'"),
        ({"category": "qa", "turns": ["hi"]}, "missing 'question_id'"),
        ({"question_id": 1, "category": "qa", "turns": []}, "'turns' must be a list"),
        ({"question_id": 1, "category": "qa", "turns": "hi"}, "'turns' must be a list"),
        ({"question_id": 1, "category": "qa", "turns": [["hi"]]}, "'turns' must be a list"),
        ({"question_id": 1, "category": "qa", "turns": ["   "]}, "'turns' must be a list"),
        ({"question_id": 1, "category": "", "turns": ["hi"]}, "'category' must be a non-empty string"),
        ({"question_id": 1, "category": "a/b", "turns": ["hi"]}, "without '/'"),
        ({"question_id": None, "category": "qa", "turns": ["hi"]}, "'question_id' must be"),
        ({"question_id": True, "category": "qa", "turns": ["hi"]}, "'question_id' must be"),
    ],
)
def test_a_malformed_spec_bench_line_is_a_dataset_error_naming_file_line_and_field(tmp_path, record, message):
    good = {"question_id": 0, "category": "qa", "turns": ["fine"]}
    path = _write_lines(tmp_path / "bad.jsonl", good, record)
    with pytest.raises(DatasetError, match=message) as info:
        load_prompt_file(path)
    assert f"{path}:2:" in str(info.value)


def test_the_bundled_spec_bench_set_has_311_questions_in_13_categories_with_its_licence():
    prompts = load_tasks(["spec_bench"])
    assert len(prompts) == 311
    assert tuple(dict.fromkeys(p.task for p in prompts)) == SPEC_BENCH_CATEGORIES
    folder = spec_bench_path().parent
    assert "Apache" in (folder / "NOTICE.md").read_text()
    assert "Version 2.0" in (folder / "LICENSE-Apache-2.0.txt").read_text()


def test_limit_takes_the_first_n_questions_of_each_category_in_file_order():
    records = [json.loads(line) for line in spec_bench_path().read_text().splitlines() if line.strip()]
    expected = []
    for category in SPEC_BENCH_CATEGORIES:
        mine = [(r["category"], str(r["question_id"]), r["turns"][0]) for r in records]
        expected += [entry for entry in mine if entry[0] == category][:3]
    prompts = load_tasks(["spec_bench"], limit=3)
    assert [(p.task, p.id, p.text) for p in prompts] == expected and len(prompts) == 39


def test_limit_per_task_keeps_order_across_interleaved_tasks():
    prompts = [BenchPrompt(task, str(i), "x", "x") for i, task in enumerate("abacbcaab")]
    kept = [(p.task, p.id) for p in limit_per_task(prompts, 2)]
    assert kept == [("a", "0"), ("b", "1"), ("a", "2"), ("c", "3"), ("b", "4"), ("c", "5")]
    assert limit_per_task(prompts, None) == prompts
    assert len(limit_per_task(prompts, 100)) == len(prompts)
    with pytest.raises(DatasetError, match="limit must be >= 1"):
        limit_per_task(prompts, 0)


def test_the_issue_set_is_one_selection_chat_categories_beside_the_code_tasks(tmp_path):
    prompts = select_prompts("spec_bench,humaneval,code_edit", None, 3)
    tasks = list(dict.fromkeys(p.task for p in prompts))
    assert tasks == [*SPEC_BENCH_CATEGORIES, "humaneval", "code_edit"]
    assert all(sum(p.task == t for p in prompts) == 3 for t in tasks)
    # A file alone runs no default task; a file beside --tasks comes after them, cut per category too.
    path = _write_lines(tmp_path / "q.jsonl", *({"question_id": i, "category": "qa" if i % 2 else "rag",
                                                 "turns": [f"q{i}"]} for i in range(6)))
    chosen = [(p.task, p.id) for p in select_prompts(None, path, 2)]
    assert chosen == [("rag", "0"), ("qa", "1"), ("rag", "2"), ("qa", "3")]
    assert [p.task for p in select_prompts("humaneval", path, 1)] == ["humaneval", "rag", "qa"]
    # Runs are paired across methods by (task, id): the bundled set given twice is refused, not mispaired.
    with pytest.raises(DatasetError, match="appears twice"):
        select_prompts("spec_bench", str(spec_bench_path()), 1)


# -- --threads --------------------------------------------------------------------------------------------

def test_thread_lists_parse_and_bad_values_are_config_errors():
    assert parse_thread_list(None) == (None,)
    assert parse_thread_list(2) == (2,)  # from a --config file
    assert parse_thread_list("2") == (2,)
    assert parse_thread_list(" 1, 2 ") == (1, 2)
    assert parse_thread_list("2,1,2") == (2, 1)
    for bad in ("0", "-1", "x", "1,,2", "", "1.5", "1;2", "2,0", True, 1.5):
        with pytest.raises(ConfigError, match="--threads"):
            parse_thread_list(bad)


def test_a_thread_list_runs_the_whole_matrix_per_count_with_models_loaded_for_it(tmp_path, monkeypatch,
                                                                                  capsys):
    from specdec.backends.pytorch.backend import TransformersBackend
    from test_bench import tiny_model, tiny_tokenizer

    loads = []

    def load(cls, ref):
        loads.append(ref.threads)
        tokenizer = tiny_tokenizer()
        return SpecDecoder(TransformersBackend(tiny_model(0, 2), tokenizer, name="t", max_context=1024),
                           TransformersBackend(tiny_model(1, 1), tokenizer, name="d", max_context=1024))

    monkeypatch.setattr(SpecDecoder, "load", classmethod(load))
    records = [{"question_id": i, "category": c, "turns": [f"Return the {c} {i}"]}
               for i, c in enumerate(("qa", "rag", "qa"))]
    questions = _write_lines(tmp_path / "q.jsonl", *records)
    out = tmp_path / "res"
    threads_before = torch.get_num_threads()
    try:
        code = main(["bench", "org/target", "--draft", "org/draft", "--prompts", questions,
                     "--threads", "1,2", "--methods", "plain,spec_k2", "--max-tokens", "4", "--no-warmup",
                     "--no-plot", "--out", str(out)])
    finally:
        torch.set_num_threads(threads_before)
    assert code == 0 and loads == [1, 2]
    for n in (1, 2):
        data = json.loads((out / f"threads-{n}" / "results.json").read_text())
        assert data["config"]["threads"] == n and data["summary"]["tasks"] == ["qa", "rag"]
        assert len(data["runs"]) == 3 * 2  # every prompt, every method, at this count
        # At most the prompt (less any prefix a cache kept from the previous request).
        assert all(0 < r["prefill_tokens"] <= r["prompt_tokens"] for r in data["runs"])
        assert data["summary"]["overall"]["spec_k2"]["prefill_tokens_per_second"] > 0
    index = json.loads((out / "threads.json").read_text())
    assert index["thread_counts"] == [1, 2] and index["relative_per_task"]["2"]["baseline"] == "plain"
    markdown = (out / "results.md").read_text()
    assert "# specdec bench at 1, 2 threads" in markdown
    assert "## 1 thread\n" in markdown and "## 2 threads\n" in markdown
    assert "| spec_k2 |" in capsys.readouterr().out


# -- the report's math, on synthetic runs ----------------------------------------------------------------

def _run(method, task, prompt_id, rate, tokens=100, prompt=201, prefill=0.5, timings=None):
    seconds = tokens / rate
    stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
             "num_accepted_tokens_per_pos": [], "num_drafts_per_pos": [], "num_target_forwards": tokens,
             "num_generated_tokens": tokens, "num_prompt_tokens": prompt, "draft_seconds": 0.0,
             "target_seconds": seconds, "prefill_seconds": prefill, "total_seconds": seconds}
    # As the runner records it: llama-server prefills the whole prompt, our engine all but its last token.
    prefilled = (prompt if timings else prompt - 1) if prefill else None
    run = {"method": method, "task": task, "prompt_id": prompt_id, "repeat": 0, "prompt_tokens": prompt,
           "prefill_tokens": prefilled, "generated_tokens": tokens, "seconds": seconds,
           "tokens_per_second": rate, "finish_reason": "length", "stats": stats,
           "target_forwards": NO_FORWARDS, "draft_forwards": NO_FORWARDS,
           "backend_counters": {"target": {"calls": 0, "seconds": 0.0},
                                "draft": {"calls": 0, "seconds": 0.0}}}
    if timings:
        run["llamacpp_settings"] = {"timings": timings}
    return run


def _results(rates: dict[str, dict[str, float]]) -> dict:
    """rates[method][task] = tok/s of that method's one run in that task."""
    methods, _ = resolve_methods(",".join(rates), MethodOptions(), has_draft_model=True)
    runs = []
    for name, per_task in rates.items():
        for task, rate in per_task.items():
            # The server's own decode clock reads 0.9 of the wall time here.
            timings = {"prompt_n": 201, "predicted_n": 100, "predicted_ms": 100 / rate * 900}
            peer = name.startswith("llamacpp")
            runs.append(_run(name, task, f"{task}-1", rate, timings=timings if peer else None))
    results = {
        "config": {"methods": [m.to_dict() for m in methods], "num_prompts": len(runs), "repeats": 1,
                   "chat": True, "sampling": {"greedy": True, "max_tokens": 100, "ignore_eos": True}},
        "environment": {"cpu_count": 2, "torch": "x", "transformers": "y", "torch_threads": 1},
        "runs": runs,
    }
    results["summary"] = summarise(results)
    return results


def test_per_category_ratios_overall_and_the_worst_category_against_llamacpp_plain():
    results = _results({
        "plain": {"A": 10.0, "B": 10.0, "C": 10.0},
        "adaptive": {"A": 12.0, "B": 11.0, "C": 9.0},  # faster overall, yet below the reference in C
        "llamacpp_plain": {"A": 10.0, "B": 10.0, "C": 10.0},
    })
    relative = results["summary"]["relative_per_task"]
    assert relative["baseline"] == "llamacpp_plain" and "llamacpp_plain" not in relative["overall"]
    assert relative["per_task"]["A"]["adaptive"] == pytest.approx(1.2)
    assert relative["per_task"]["C"]["adaptive"] == pytest.approx(0.9)
    # Overall = all tokens over all seconds, not the mean of the task ratios.
    overall_rate = 300 / (100 / 12 + 100 / 11 + 100 / 9)
    assert relative["overall"]["adaptive"] == pytest.approx(overall_rate / 10, abs=1e-4)
    assert relative["min"]["adaptive"] == {"ratio": pytest.approx(0.9), "task": "C", "tasks_measured": 3,
                                           "tasks": 3}
    assert relative["min"]["plain"]["ratio"] == pytest.approx(1.0)
    table = category_table(results["summary"])
    assert "| task | llamacpp_plain tok/s | plain | adaptive |" in table
    assert "| C | 10.00 | 1.00x | 0.90x |" in table
    assert "| **min over tasks** | | 1.00x (A) | 0.90x (C) |" in table


def test_decode_speed_and_answer_length_are_shown_apart_from_tok_s_per_task():
    """A method whose answer ends at half the length decodes 1.5x faster yet reads 0.83x in tok/s over the
    same 4 s prefill; the section tells the two apart. Controls: a method equal to the reference reads
    1.00x / 1.00x, and one missing from a task reads '–' there."""
    names = "plain,adaptive,prompt_lookup,llamacpp_plain"
    methods, _ = resolve_methods(names, MethodOptions(), has_draft_model=True)
    timings = {"prompt_n": 201, "predicted_n": 100, "predicted_ms": 6000.0}
    runs = [_run("llamacpp_plain", "A", "A-1", 10.0, prefill=4.0, timings=timings),
            _run("llamacpp_plain", "B", "B-1", 10.0, prefill=4.0, timings=timings),
            _run("plain", "A", "A-1", 10.0, prefill=4.0), _run("plain", "B", "B-1", 10.0, prefill=4.0),
            _run("adaptive", "A", "A-1", 50 / 6.0, tokens=50, prefill=4.0),  # decode 25 tok/s vs 100 / 6
            _run("adaptive", "B", "B-1", 10.0, prefill=4.0),
            _run("prompt_lookup", "A", "A-1", 10.0, prefill=4.0)]
    sampling = {"greedy": True, "max_tokens": 100, "ignore_eos": False}
    results = {"config": {"methods": [m.to_dict() for m in methods], "num_prompts": 2, "repeats": 1,
                          "chat": True, "sampling": sampling},
               "environment": {"cpu_count": 2, "torch": "x", "transformers": "y", "torch_threads": 1},
               "runs": runs}
    results["summary"] = summary = summarise(results)
    assert summary["relative_per_task"]["per_task"]["A"]["adaptive"] == pytest.approx(0.8333, abs=1e-3)
    table = speed_and_length(summary, "llamacpp_plain", ["plain", "adaptive", "prompt_lookup"])
    assert table["per_task"]["A"]["adaptive"] == {"decode": pytest.approx(1.5), "length": pytest.approx(0.5)}
    assert table["per_task"]["B"]["adaptive"] == {"decode": pytest.approx(1.0), "length": pytest.approx(1.0)}
    assert table["per_task"]["A"]["plain"] == {"decode": pytest.approx(1.0), "length": pytest.approx(1.0)}
    assert table["per_task"]["B"]["prompt_lookup"] == {"decode": None, "length": None}
    # Overall: 150 tokens in 2 + 6 s of decoding against 200 in 6 + 6 s.
    assert table["overall"]["adaptive"]["decode"] == pytest.approx((150 / 8.0) / (200 / 12.0), abs=1e-3)
    markdown = to_markdown(results)
    assert "## Decode speed and answer length per task relative to llamacpp_plain" in markdown
    assert "| A | 1.00x / 1.00x | 1.50x / 0.50x | 1.00x / 1.00x |" in markdown
    assert "| B | 1.00x / 1.00x | 1.00x / 1.00x | – / – |" in markdown


def test_without_the_llamacpp_peer_the_reference_is_our_plain_and_gaps_are_shown():
    results = _results({"plain": {"A": 10.0, "B": 20.0}, "prompt_lookup": {"A": 15.0}})
    relative = results["summary"]["relative_per_task"]
    assert relative["baseline"] == "plain"
    assert relative["per_task"]["B"]["prompt_lookup"] is None
    # Negative control: the minimum over the one measured task must not read as a minimum over all.
    assert relative["min"]["prompt_lookup"] == {"ratio": pytest.approx(1.5), "task": "A", "tasks_measured": 1,
                                                "tasks": 2}
    assert "1.50x (A; 1/2 tasks)" in category_table(results["summary"])


def test_prefill_and_decode_rates_per_method_and_the_servers_own_decode_rate():
    results = _results({"plain": {"A": 10.0, "B": 20.0}, "llamacpp_plain": {"A": 10.0, "B": 20.0}})
    plain = results["summary"]["overall"]["plain"]
    # Our engine prefills all prompt tokens but the last: 2 x 200 tokens in 2 x 0.5 s.
    assert plain["prefill_tokens_per_second"] == pytest.approx(400.0)
    assert plain["decode_tokens_per_second"] == pytest.approx(200 / (10 + 5 - 1.0), abs=1e-3)
    assert plain["server_decode_tokens_per_second"] is None
    peer = results["summary"]["overall"]["llamacpp_plain"]
    assert peer["prefill_tokens_per_second"] == pytest.approx(402.0)  # llama-server's prompt_n: all 201
    # 200 tokens in 0.9 x (10 + 5) s by the server's own clock.
    assert peer["server_decode_tokens_per_second"] == pytest.approx(200 / 13.5, abs=1e-3)
    markdown = to_markdown(results)
    assert "| plain | 13.33 | 400.0 | 14.29 |" in markdown
    assert "## tok/s per task relative to llamacpp_plain" in markdown


def test_prefill_tokens_count_what_each_framework_ran_through_its_prefill():
    from specdec.bench.method.runner import _Outcome, _prefill_tokens
    from specdec.core.stats import SpecStats

    ours, = resolve_methods("plain", MethodOptions())[0]
    peer = resolve_methods("llamacpp_plain", MethodOptions())[0][-1]
    timed = SpecStats(prefill_seconds=0.2)
    # The whole prompt: its last row gives the first token.
    assert _prefill_tokens(ours, range(50), _Outcome([], 1.0, "length", timed)) == 50
    timed.num_cached_prompt_tokens = 30  # a prefix kept from the previous request is not prefilled
    assert _prefill_tokens(ours, range(50), _Outcome([], 1.0, "length", timed)) == 20
    served = _Outcome([], 1.0, "length", SpecStats(prefill_seconds=0.2), {"timings": {"prompt_n": 50}})
    assert _prefill_tokens(peer, range(50), served) == 50
    assert _prefill_tokens(ours, range(50), _Outcome([], 1.0, "length", SpecStats())) is None  # nothing timed


def test_a_run_without_a_timed_prefill_has_no_prefill_rate():
    run = _run("hf_plain", "A", "1", 10.0, prefill=0.0)
    methods, _ = resolve_methods("hf_plain", MethodOptions(), has_draft_model=True)
    results = {"config": {"methods": [m.to_dict() for m in methods]}, "runs": [run]}
    row = summarise(results)["overall"]["hf_plain"]
    assert row["prefill_tokens_per_second"] is None and row["decode_tokens_per_second"] is None


def test_the_report_of_several_thread_counts_has_one_overview_row_per_method():
    one = _results({"plain": {"A": 10.0, "B": 10.0}, "adaptive": {"A": 12.0, "B": 9.5}})
    two = _results({"plain": {"A": 18.0, "B": 18.0}, "adaptive": {"A": 20.0, "B": 18.0}})
    markdown = to_markdown_by_threads({1: one, 2: two})
    assert "| adaptive | 1.06x | 0.95x (B) | 1.05x | 1.00x (B) |" in markdown
    assert markdown.count("\n## tok/s per task relative to plain") == 0  # demoted inside each count's part
    assert markdown.count("\n### tok/s per task relative to plain") == 2


def test_the_default_pair_brings_its_draft_model_only_for_methods_that_need_one():
    from specdec.bench.cli import bench_model_ref
    from specdec.cli.main import build_parser

    def draft_of(methods: str, *extra: str):
        args = build_parser().parse_args(["bench", "--methods", methods, *extra])
        return bench_model_ref(args, threads=2).draft

    assert draft_of("plain,prompt_lookup_adaptive,llamacpp_plain") is None
    assert draft_of("plain,adaptive") == "default-draft"
    assert draft_of("plain,llamacpp_spec") == "default-draft"
    assert draft_of("plain,hybrid_adaptive") == "default-draft"
    assert draft_of("plain", "--draft", "other.gguf") == "other.gguf"  # the user's draft wins


# -- multi-turn (--turns 2) ---------------------------------------------------------------------------------

def test_second_turns_follow_their_first_and_the_limit_counts_questions(tmp_path):
    path = _write_lines(
        tmp_path / "q.jsonl",
        {"question_id": 1, "category": "writing", "turns": ["w1 w2", "w5 w6"]},
        {"question_id": 2, "category": "writing", "turns": ["w7", "w8"]},
        {"question_id": 3, "category": "rag", "turns": ["w9"]},  # one turn: nothing to add
    )
    prompts = select_prompts(None, path, limit=1, turns=2)
    assert [(p.task, p.id, p.text, p.earlier_ids) for p in prompts] == [
        ("writing", "1", "w1 w2", ()), ("writing", "1-turn2", "w5 w6", ("1",)), ("rag", "3", "w9", ()),
    ]
    assert [p.id for p in select_prompts(None, path, limit=None, turns=1)] == ["1", "2", "3"]
    with pytest.raises(DatasetError, match="turns"):
        select_prompts(None, path, limit=None, turns=0)


def _two_turn_run(tmp_path, methods_text):
    from conftest import tiny_qwen2, tiny_tokenizer
    from specdec.backends.pytorch.backend import TransformersBackend
    from specdec.bench.method.runner import BenchConfig, run_bench
    from specdec.config import SamplingParams

    tokenizer = tiny_tokenizer()
    decoder = SpecDecoder(TransformersBackend(tiny_qwen2(0), tokenizer, max_context=512), None)
    path = _write_lines(tmp_path / "q.jsonl", {"question_id": 7, "category": "writing", "turns": ["w4 w5 w6", "w9 w10"]})
    methods, _ = resolve_methods(methods_text, MethodOptions(), has_draft_model=False)
    methods = [m for m in methods if m.name in methods_text.split(",")]  # resolve_methods always adds plain
    config = BenchConfig(methods=methods, params=SamplingParams(max_tokens=6, ignore_eos=True), warmup=False, chat=False)
    return decoder, run_bench(decoder, select_prompts(None, path, None, turns=2), config, log=lambda m: None)


def test_a_second_turn_runs_on_the_conversation_with_plain_decodings_answer(tmp_path):
    decoder, results = _two_turn_run(tmp_path, "plain,suffix_adaptive")
    first, second = results["outputs"]["writing/7"], results["outputs"]["writing/7-turn2"]
    conversation = f"w4 w5 w6\n{first['plain_text']}\n\nw9 w10"
    assert second["prompt_tokens"] == len(decoder.encode(conversation, chat=False))
    assert {(r["prompt_id"], r["method"]) for r in results["runs"]} == {
        (q, m) for q in ("7", "7-turn2") for m in ("plain", "suffix_adaptive")}
    # Every timed run prefilled cold: no method found the previous run's conversation kept in its cache.
    assert all(r["stats"]["num_cached_prompt_tokens"] == 0 for r in results["runs"])
    assert all(r["prefill_tokens"] == r["prompt_tokens"] for r in results["runs"])


def test_second_turns_need_the_plain_method(tmp_path):
    with pytest.raises(ValueError, match="plain method"):
        _two_turn_run(tmp_path, "suffix_adaptive")


def test_per_task_paired_intervals_say_whether_a_low_ratio_is_inside_the_noise():
    """Task A: three prompts at 0.9x, 1.0x and 1.1x of llama-server (geometric mean 0.997x, an interval around 1);
    task B: three at 0.80x, 0.81x, 0.79x (a loss the run shows: the interval's top is below 1). Computed here from
    the Student-t quantile t(0.975, 2) = 4.3027 on the log ratios, independently of intervals.py."""
    import math

    from specdec.bench.method.paired import paired_intervals, paired_markdown

    ratios = {"A": [0.9, 1.0, 1.1], "B": [0.80, 0.81, 0.79]}
    runs = []
    for task, values in ratios.items():
        for n, ratio in enumerate(values):
            runs += [_run("llamacpp_plain", task, f"{task}{n}", 10.0), _run("adaptive", task, f"{task}{n}", 10.0 * ratio)]
    intervals = paired_intervals(runs, "llamacpp_plain", ["adaptive", "llamacpp_plain"], ["A", "B"])
    assert list(intervals["overall"]) == ["adaptive"]
    for task, values in ratios.items():
        logs = [math.log(v) for v in values]
        mean = sum(logs) / 3
        half = 4.302653 * math.sqrt(sum((x - mean) ** 2 for x in logs) / 2) / math.sqrt(3)
        entry = intervals["per_task"][task]["adaptive"]
        assert entry["estimate"] == pytest.approx(math.exp(mean), abs=1e-4) and entry["pairs"] == 3
        assert entry["low"] == pytest.approx(math.exp(mean - half), abs=1e-4)
        assert entry["high"] == pytest.approx(math.exp(mean + half), abs=1e-4)
    assert intervals["per_task"]["A"]["adaptive"]["low"] < 1 < intervals["per_task"]["A"]["adaptive"]["high"]
    assert intervals["per_task"]["B"]["adaptive"]["high"] < 1
    assert intervals["overall"]["adaptive"]["pairs"] == 6
    one = paired_intervals(runs[:2], "llamacpp_plain", ["adaptive"], ["A"])  # one pair: no interval
    assert one["per_task"]["A"]["adaptive"] is None
    text = "\n".join(paired_markdown(intervals, "llamacpp_plain"))
    b = intervals["per_task"]["B"]["adaptive"]
    assert f"| B | {b['estimate']:.2f}x [{b['low']:.2f}, {b['high']:.2f}] |" in text
    assert "| **all prompts** |" in text and "95% interval" in text


def test_noise_floor_measures_identical_work_and_what_a_task_can_resolve():
    """plain and llama-server plain with the same tokens are an A/A pair: two tasks whose log ratios sit at their means
    -0.02, 0, +0.02 give a pooled within-task standard deviation of exactly 0.02; a task of 3 resolves
    expm1(t(0.975, 2) * 0.02 / sqrt 3), all 6 prompts expm1(t(0.975, 5) * 0.02 / sqrt 6); +-3% takes 5 prompts
    (t(0.975, 3) = 3.182446 gives 3.2%, t(0.975, 4) = 2.776445 gives 2.5%). Student-t values from tables. A turn whose
    tokens differed (negative control: a ratio of 2) is not identical work and must be left out."""
    import math

    from specdec.bench.method.paired import noise_floor, noise_floor_markdown

    runs = []
    for task, centre in (("A", 1.0), ("B", 1.05)):
        for n, step in enumerate((-0.02, 0.0, 0.02)):
            reference = _run("llamacpp_plain", task, f"{task}{n}", 10.0)
            reference["identical_to_plain"] = True
            runs += [reference, _run("plain", task, f"{task}{n}", 10.0 * centre * math.exp(step))]
    differed = _run("llamacpp_plain", "A", "A9", 10.0)
    differed["identical_to_plain"] = False
    runs += [differed, _run("plain", "A", "A9", 20.0)]
    floor = noise_floor(runs, "llamacpp_plain", ["A", "B"])
    assert floor["turns"] == 6 and floor["of"] == 7 and floor["pair"] == ["plain", "llamacpp_plain"]
    assert floor["sd_log"] == pytest.approx(0.02, abs=1e-9)
    task_half_width = math.expm1(4.302653 * 0.02 / math.sqrt(3))
    assert floor["per_task"]["A"] == {"prompts": 3, "half_width": pytest.approx(task_half_width, abs=1e-5)}
    assert floor["all_half_width"] == pytest.approx(math.expm1(2.570582 * 0.02 / math.sqrt(6)), abs=1e-5)
    assert floor["prompts_for_bar"] == 5
    one_task = 0.5 * (1 + math.erf(-math.log(0.97) / (0.02 / math.sqrt(3)) / math.sqrt(2)))
    assert floor["chance_all_clear_bar"] == pytest.approx(one_task ** 2, abs=1e-9)
    text = noise_floor_markdown(floor)[0]
    assert "6 of 7 prompts" in text and "standard deviation 2.0%" in text and "takes 5 prompts per task" in text
    assert "a task's ratio is known to +-5% with 3 prompts (95%)" in text and "in 99% of runs" in text
    assert noise_floor(runs, "plain", ["A", "B"]) is None  # the reference itself is plain: no A/A pair
    steady = [dict(r, tokens_per_second=10.0) for r in runs if r["prompt_id"] != "A9"]  # no spread at all
    assert noise_floor(steady, "llamacpp_plain", ["A", "B"])["chance_all_clear_bar"] == 1.0
    for record in runs:
        record.pop("identical_to_plain", None)
    assert noise_floor(runs, "llamacpp_plain", ["A", "B"]) is None and noise_floor_markdown(None) == []
