"""`specdec tune` on tiny random models (no downloads): ranking under a deterministic fake clock, the no-draft
recommendation, unusable drafts, the config file round trip into generate/serve/bench, and the CLI end to end."""

from __future__ import annotations

import copy
import json
import time

import pytest

from conftest import save_tiny_model, tiny_llama, tiny_qwen2, tiny_tokenizer
from specdec.backends.pytorch.backend import TransformersBackend
from specdec.bench.datasets import BenchPrompt
from specdec.bench.method.methods import MethodOptions, expand_method
from specdec.cli.flags import model_ref_from_args, sampling_from_args, spec_from_args
from specdec.cli.main import build_parser, main
from specdec.config import ConfigError, ModelRef, SamplingParams, SpecConfig
from specdec.tune import (
    DraftCandidate,
    TuneOptions,
    bench_method_name,
    methods_for,
    parse_drafts,
    rank,
    read_run_config,
    tune,
    write_outputs,
    write_run_config,
)

# The fake clock's cost model: a target pass costs 1 plus 0.5 per extra row (a compute-bound verify), a draft
# forward 0.05. Only forwards advance it, so every measured time is a deterministic function of the tokens.
TARGET_COST, TARGET_ROW_COST, DRAFT_COST = 1.0, 0.5, 0.05
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


class FakeClock:
    """time.perf_counter for the test: advanced by forward hooks on the tiny models, never by wall time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def charge(self, model, fixed: float, per_extra_row: float = 0.0):
        def advance(module, args, kwargs, output):
            rows = int(kwargs["input_ids"].shape[-1])
            self.now += fixed + per_extra_row * (rows - 1)

        # Registered before the bench runner's probes, so it runs first and they see the advanced clock.
        return model.register_forward_hook(advance, with_kwargs=True)


@pytest.fixture()
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen2(seed=0, layers=3)
    return {
        "target": target,
        "good": copy.deepcopy(target),  # the target as its own draft: every greedy draft token is accepted
        "bad": tiny_qwen2(seed=7, layers=1),  # random weights: almost nothing is accepted
        "bad2": tiny_qwen2(seed=8, layers=1),
        "wide": tiny_qwen2(seed=9, layers=1, vocab=120),  # more token ids than the target: cannot be paired
    }


def _backends(models, clock, *names):
    target = TransformersBackend(models["target"], tiny_tokenizer(), name="tiny-target", max_context=256)
    hooks = [clock.charge(models["target"], TARGET_COST, TARGET_ROW_COST)]
    drafts = []
    for name in names:
        hooks.append(clock.charge(models[name], DRAFT_COST))
        drafts.append(DraftCandidate(name, f"/models/{name}", TransformersBackend(models[name], name=name,
                                                                                  max_context=256)))
    return target, drafts, hooks


def _prompts(n=3):
    texts = [" ".join(f"w{4 + (7 * i + 5 * j) % 90}" for j in range(10)) for i in range(n)]
    return [BenchPrompt("mine", str(i), text, text) for i, text in enumerate(texts)]


def _remove(hooks):
    for hook in hooks:
        hook.remove()


# -- ranking under the fake clock -----------------------------------------------------------------------------

def test_tune_ranks_the_target_as_its_own_draft_above_a_random_draft_and_flags_slowdowns(models, clock):
    target, drafts, hooks = _backends(models, clock, "bad", "good", "wide")
    try:
        result = tune(target, drafts, _prompts(), TuneOptions(drafters=("draft_model",), k_sweep=(3,)),
                      PARAMS, log=lambda message: None)
    finally:
        _remove(hooks)
    rows = result.rows
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    assert {(r["draft"], r["k_policy"]) for r in rows} == {(d, p) for d in ("good", "bad") for p in ("fixed", "adaptive")}
    assert rows[0]["draft"] == "good" and rows[1]["draft"] == "good"
    good = next(r for r in rows if r["draft"] == "good" and r["k_policy"] == "fixed")
    bad = next(r for r in rows if r["draft"] == "bad" and r["k_policy"] == "fixed")
    assert good["acceptance_rate"] == 1.0 and good["acceptance_rate_per_pos"] == [1.0, 1.0, 1.0]
    assert bad["acceptance_rate"] < 0.3
    # Under the cost model: 4 tokens per (1 + 2 x 0.5 + 3 x 0.05) for the good draft, about 1 for the bad one.
    assert good["speedup"] > 1.25 and not good["slower"] and good["verdict"] == "faster"
    assert bad["speedup"] < 0.7 and bad["slower"] and bad["verdict"] == "SLOWER than plain"
    assert good["leviathan_bound"] is not None and good["cost_ratio"] == pytest.approx(DRAFT_COST, rel=0.01)
    assert all(r["identical_to_plain"] for r in rows)  # lossless whichever draft
    rec = result.recommendation
    assert rec.speculate and rec.row["draft"] == "good" and rec.draft_reference == "/models/good"
    assert rec.spec.drafter == "draft_model"
    assert [u["draft"] for u in result.unusable] == ["wide"] and "120" in result.unusable[0]["reason"]
    assert [run["label"] for run in result.runs] == ["bad", "good"]


def test_tune_recommends_no_draft_when_every_candidate_slows_generation(models, clock, tmp_path, monkeypatch):
    import specdec.tune.run

    monkeypatch.setattr(specdec.tune.run, "MAX_CONFIGURATIONS_PER_RUN", 1)  # each in its own run with plain
    target, drafts, hooks = _backends(models, clock, "bad", "bad2")
    try:
        result = tune(target, drafts, _prompts(2), TuneOptions(drafters=("draft_model",), k_sweep=(2,)),
                      PARAMS, log=lambda message: None)
    finally:
        _remove(hooks)
    assert len(result.rows) == 2 * 2  # drafts x policies
    assert [run["label"] for run in result.runs] == [f"{d} (part {i} of 2)" for d in ("bad", "bad2") for i in (1, 2)]
    assert all(r["speedup"] < 1.03 for r in result.rows)
    assert all(r["slower"] for r in result.rows if r["k_policy"] == "fixed")
    rec = result.recommendation
    assert not rec.speculate and "plain" in rec.reason
    assert rec.spec.drafter == "none" and rec.draft_reference is None
    paths = write_outputs(result, tmp_path, base_ref=ModelRef(target="/models/target", draft=None), plot=True)
    written = read_run_config(paths["config"])
    assert written.model.draft is None and written.spec.drafter == "none" and not written.info["speculate"]
    markdown = paths["markdown"].read_text()
    assert "Slower than plain decoding" in markdown and "decode plainly" in markdown
    assert paths["plot_speedup"].stat().st_size > 0 and paths["plot_positions"].stat().st_size > 0


# -- pure parts -----------------------------------------------------------------------------------------------

def _row(name, speedup, identical=True, a=0.5, low=None, high=None, drafts=10, bound=2.0):
    """A measured row as rows_from_results makes it; (low, high): the paired speedup's 95% interval."""
    interval = None if low is None else {"estimate": speedup, "low": low, "high": high, "pairs": 5,
                                         "confidence": 0.95}
    return {"candidate": name, "speedup": speedup, "speedup_paired": speedup, "speedup_interval": interval,
            "acceptance_rate": a if drafts else None, "identical_to_plain": identical, "num_drafts": drafts,
            "mean_k": 3.0 if drafts else None, "leviathan_bound": bound if drafts else None,
            "draft_reference": f"/{name}", "spec": {"drafter": "draft_model", "num_speculative_tokens": 3},
            "draft": name, "drafter": "draft_model", "k_policy": "fixed", "k": 3, "cost_model_bound": None,
            "mean_acceptance_length": None, "cost_ratio": None, "verify_cost": None,
            "paired_runs": 5 if interval else 1,
            "num_identical_to_plain": "5/5", "speedup_per_task": {}, "acceptance_rate_per_pos": []}


def test_rank_orders_by_evidence_then_speedup_and_never_recommends_a_lossy_or_marginal_configuration():
    ranked, rec = rank([_row("a", 1.2, low=1.1, high=1.3), _row("b", 1.6, identical=False, low=1.4, high=1.8),
                        _row("c", 0.8, low=0.7, high=0.9), _row("d", None)], 1.03)
    assert [r["candidate"] for r in ranked] == ["b", "a", "c", "d"]
    assert ranked[0]["verdict"].startswith("NOT IDENTICAL") and ranked[2]["slower"] and not ranked[3]["slower"]
    assert ranked[1]["verdict"] == "faster" and ranked[2]["verdict"] == "SLOWER than plain"
    assert rec.speculate and rec.row["candidate"] == "a" and rec.draft_reference == "/a"
    assert "95% CI 1.10-1.30x" in rec.reason
    _, rec = rank([_row("a", 1.02, low=1.01, high=1.03), _row("c", 0.8, low=0.7, high=0.9)], 1.03)
    assert not rec.speculate and rec.row["candidate"] == "a" and "below --min-speedup" in rec.reason
    _, rec = rank([_row("a", 1.02, low=1.01, high=1.03)], 1.0)
    assert rec.speculate  # negative control: the threshold is what refused it above
    _, rec = rank([], 1.03)
    assert not rec.speculate and rec.spec == SpecConfig(drafter="none", k_policy="adaptive")


def test_rank_calls_an_interval_that_includes_one_no_faster_than_plain():
    """Noise is not signal: a higher point whose interval includes 1 ranks below a smaller, certain gain, and
    a point below 1 whose interval includes 1 is not called slower."""
    ranked, rec = rank([_row("noisy", 1.18, low=0.92, high=1.51), _row("sure", 1.08, low=1.04, high=1.12),
                        _row("dip", 0.93, low=0.80, high=1.08)], 1.03)
    assert [r["candidate"] for r in ranked] == ["sure", "noisy", "dip"]
    assert ranked[1]["verdict"] == ranked[2]["verdict"] == "no faster than plain"
    assert not any(r["slower"] for r in ranked)
    assert rec.speculate and rec.row["candidate"] == "sure"
    # Without the certain one, nothing is recommended, and the answer says so.
    _, rec = rank([_row("noisy", 1.18, low=0.92, high=1.51), _row("dip", 0.93, low=0.80, high=1.08)], 1.03)
    assert not rec.speculate and rec.reason.startswith("do not speculate here: no configuration is shown faster")
    assert "best measured: noisy at 1.18x, 95% CI 0.92-1.51x)" in rec.reason and rec.spec.drafter == "none"
    # One paired run gives no interval: nothing is shown, however large the single ratio.
    ranked, rec = rank([_row("once", 1.4)], 1.03)
    assert ranked[0]["verdict"] == "not shown faster: one paired run, no interval" and not rec.speculate


def test_a_configuration_that_never_drafted_is_plain_decoding_whatever_its_timing(tmp_path):
    """Issue 17: a configuration that never drafted measured 1.18x (timing noise, above its own bound of 1.0:
    it decoded plainly) and was written to tuned.json."""
    never = _row("never", 1.18, low=1.12, high=1.25, drafts=0)
    ranked, rec = rank([never, _row("dip", 0.95, low=0.85, high=1.06)], 1.03)
    assert ranked[0]["candidate"] == "never" and ranked[0]["verdict"] == "never drafted: plain decoding"
    assert ranked[0]["own_bound"] == 1.0 and ranked[0]["above_bound"] == 1.18
    assert not rec.speculate and rec.spec.drafter == "none" and rec.draft_reference is None
    # A configuration that drafted is flagged too when it beats its Leviathan bound, but still ranked.
    ranked, rec = rank([_row("lucky", 1.5, low=1.3, high=1.7, bound=1.2)], 1.03)
    assert ranked[0]["above_bound"] == 1.5 and rec.speculate
    ranked, _ = rank([_row("fine", 1.19, low=1.1, high=1.3, bound=1.2)], 1.03)
    assert ranked[0]["above_bound"] is None  # negative control

    from specdec.tune.report import above_bound_text
    from specdec.tune.run import TuneResult

    ranked, rec = rank([never], 1.03)
    result = TuneResult(ranked, rec, info={"num_prompts": 5, "tasks": ["mine"], "repeats": 1})
    paths = write_outputs(result, tmp_path, base_ref=ModelRef(target="/models/target", draft=None), plot=False)
    written = read_run_config(paths["config"])
    assert written.spec.drafter == "none" and written.model.draft is None and not written.info["speculate"]
    assert written.info["best_measured"]["candidate"] == "never" and "speedup" not in written.info
    markdown = paths["markdown"].read_text()
    assert "do not speculate here" in markdown and "as drafter `none`" in markdown
    assert "timing noise" in above_bound_text(ranked[0]) and "Measured above its own bound" in markdown
    assert "What a perfect drafter would buy here" not in markdown  # no measured curve, no ceiling section
    lucky = dict(_row("lucky", 1.3, low=1.2, high=1.4), ceiling=2.5, ceiling_k=31, decode_speedup=1.71,
                 share_of_ceiling=0.684, rows_per_token=1.12)
    ranked, rec = rank([lucky], 1.03)
    markdown = write_outputs(TuneResult(ranked, rec, info={"num_prompts": 5, "tasks": ["mine"], "repeats": 1}),
                             tmp_path / "ceiling", base_ref=ModelRef(target="/t", draft=None), plot=False)
    assert "| lucky | 2.50x (31) | 1.71x | 68% | 1.12 |" in markdown["markdown"].read_text()


def test_options_drafts_and_methods():
    with pytest.raises(ConfigError, match="unknown drafter"):
        TuneOptions(drafters="draft_model,magic")
    with pytest.raises(ConfigError, match="unknown k policy"):
        TuneOptions(k_policies="fixed,guess")
    with pytest.raises(ConfigError):
        TuneOptions(k_sweep=(0,))
    options = TuneOptions(drafters="prompt_lookup,hybrid", k_policies="fixed,adaptive,heuristic", k_sweep=(2, 4))
    methods = methods_for(options.drafters, options)
    assert len(methods) == len({m.name for m in methods}) == 2 * 4
    # The adaptive maximum, without --k-max, is what generate uses for each drafter.
    adaptive = {m.spec.drafter: m.spec.num_speculative_tokens for m in methods if m.spec.k_policy == "adaptive"}
    assert adaptive == {"prompt_lookup": 32, "hybrid": 5}
    given = TuneOptions(drafters="prompt_lookup,hybrid", k_policies="adaptive", k_max=7)
    assert {m.spec.num_speculative_tokens for m in methods_for(given.drafters, given)} == {7}
    assert [d.reference for d in parse_drafts("default,org/x", "default")] == ["default-draft", "org/x"]
    assert [d.label for d in parse_drafts(None, "default")] == ["default"]
    assert parse_drafts(None, "my/model") == []


@pytest.mark.parametrize("spec", [
    SpecConfig(drafter="draft_model", num_speculative_tokens=4),
    SpecConfig(drafter="draft_model", num_speculative_tokens=6, k_policy="adaptive"),
    SpecConfig(drafter="draft_model", num_speculative_tokens=3, k_policy="heuristic"),
    SpecConfig(drafter="prompt_lookup", num_speculative_tokens=5),
    SpecConfig(drafter="prompt_lookup", num_speculative_tokens=7, k_policy="adaptive"),
    SpecConfig(drafter="hybrid", num_speculative_tokens=2, k_policy="adaptive"),
])
def test_bench_method_name_runs_the_same_spec_in_bench(spec):
    name = bench_method_name(spec)
    k = spec.num_speculative_tokens
    (method,) = expand_method(name, MethodOptions(k=k, k_max=k, k_sweep=(k,)))
    assert method.spec == spec


# -- the config file in generate, serve and bench -------------------------------------------------------------

REF = ModelRef(target="/m/target", draft="/m/draft", max_context=1024, backend="torch", threads=2,
               weight_format="bf16", draft_weight_format=None)
SPEC = SpecConfig(num_speculative_tokens=7, drafter="hybrid", k_policy="adaptive", draft_p_min=0.2,
                  lookup_max_ngram=4)


def test_config_round_trips_into_generate_and_flags_override_it(tmp_path):
    path = write_run_config(tmp_path / "tuned.json", REF, SPEC, info={"speedup": 1.4})
    args = build_parser().parse_args(["generate", "--config", str(path)])
    assert model_ref_from_args(args) == REF
    assert spec_from_args(args, has_draft_model=True) == SPEC
    # Flags win wherever they are on the line, even when they equal the flag's own default (-k 5).
    for argv in (["generate", "--config", str(path), "-k", "5", "--draft", "/m/other", "--k-policy", "fixed"],
                 ["generate", "-k", "5", "--draft", "/m/other", "--k-policy", "fixed", "--config", str(path)]):
        args = build_parser().parse_args(argv)
        assert model_ref_from_args(args).draft == "/m/other" and model_ref_from_args(args).threads == 2
        spec = spec_from_args(args, has_draft_model=True)
        assert (spec.num_speculative_tokens, spec.k_policy, spec.drafter) == (5, "fixed", "hybrid")
    # Negative control: without --config the parser's own defaults are back.
    args = build_parser().parse_args(["generate"])
    assert args.k is None and args.drafter is None and args.model == "default" and args.max_context == 4096


def test_config_in_serve_and_bench(tmp_path):
    sampled = SamplingParams(temperature=0.7, max_tokens=33, stop=("END",), seed=3)
    path = write_run_config(tmp_path / "c.json", REF, SPEC, sampled)
    serve = build_parser().parse_args(["serve", "--config", str(path), "--port", "9000"])
    assert model_ref_from_args(serve) == REF and spec_from_args(serve, True) == SPEC and serve.port == 9000
    bench = build_parser().parse_args(["bench", "--config", str(path)])
    assert bench.methods == "hybrid_adaptive" and bench.k_max == 7 and model_ref_from_args(bench) == REF
    assert sampling_from_args(bench) == sampled
    assert build_parser().parse_args(["bench", "--config", str(path), "--methods", "plain"]).methods == "plain"


@pytest.mark.parametrize("content, message", [
    (None, "cannot read config file"),
    ("{not json", "not valid JSON"),
    ('{"model": {}}', "not a specdec config file"),
    ('{"specdec_config": 1, "spec": {"num_speculative_tokens": 0}}', "num_speculative_tokens"),
    ('{"specdec_config": 1, "spec": {"colour": "red"}}', "unknown fields"),
    ('{"specdec_config": 1, "extra": {}}', "unknown sections"),
])
def test_bad_config_file_is_a_one_line_error(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--config", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("specdec generate: error: ") and err.count("\n") == 1


# -- the command end to end -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune-models")
    tokenizer = tiny_tokenizer()
    return {
        "target": save_tiny_model(root / "target", tiny_llama(0), tokenizer),
        "random": save_tiny_model(root / "random", tiny_llama(5), tokenizer),
        "other_vocab": save_tiny_model(root / "other", tiny_llama(6), tiny_tokenizer(word="v")),
    }


def test_tune_command_end_to_end_and_its_config_runs_generate(model_dirs, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": " ".join(f"w{4 + (3 * i + j) % 60}" for j in range(8))})
                                 for i in range(3)) + "\n")
    out = tmp_path / "out"
    target = model_dirs["target"]
    code = main(["tune", target, "--drafts", f"{target},{model_dirs['random']},{model_dirs['other_vocab']}",
                 "--drafters", "draft_model,prompt_lookup", "--k-policies", "fixed", "--k-sweep", "2",
                 "--prompts", str(prompts), "--limit", "2", "-n", "8", "--no-warmup", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "| rank |" in printed.out and "recommendation:" in printed.out
    report = json.loads((out / "tune.json").read_text())
    assert report["info"]["num_prompts"] == 2 and report["info"]["repeats"] == 3  # >= 5 paired runs each
    assert all(r["paired_runs"] == 6 and r["speedup_interval"]["pairs"] == 6 for r in report["rows"])
    assert {(r["draft"], r["drafter"]) for r in report["rows"]} == {
        (target, "draft_model"), (model_dirs["random"], "draft_model"), (None, "prompt_lookup")}
    assert [u["draft"] for u in report["unusable"]] == [model_dirs["other_vocab"]]
    assert "vocabularies" in report["unusable"][0]["reason"]
    for name in ("tune.md", "tuned.json", "speedup_vs_rejection.png", "acceptance_by_position.png"):
        assert (out / name).is_file(), name
    assert len(list((out / "runs").glob("*/results.md"))) == 2

    tuned = read_run_config(out / "tuned.json")  # whichever won on this machine's clock
    args = build_parser().parse_args(["generate", "--config", str(out / "tuned.json")])
    assert model_ref_from_args(args) == tuned.model
    assert spec_from_args(args, has_draft_model=tuned.model.draft is not None) == tuned.spec
    assert tuned.model.target == target and tuned.model.max_context == 2048

    # A config naming the target as its own draft, as tune writes it, drives generate end to end.
    mine = write_run_config(tmp_path / "mine.json", ModelRef(target=target, draft=target, max_context=256),
                            SpecConfig(num_speculative_tokens=3, drafter="draft_model", k_policy="fixed"))
    code = main(["generate", "--config", str(mine), "-n", "6", "--json", "--prompt", "w5 w6 w7"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    report = json.loads(printed.out)
    assert report["spec"] == {"drafter": "draft_model", "k": 3, "k_policy": "fixed"}
    assert report["identical_to_plain"] and report["stats"]["acceptance_rate"] == 1.0


def test_tune_command_says_do_not_speculate_and_writes_it(models, clock, tmp_path, monkeypatch, capsys):
    """docs/tune.md promises a message when the best choice is not to speculate: printed, and in tuned.json."""
    import specdec.tune.cli
    from specdec.tune.cli import run_tune_command

    target, drafts, hooks = _backends(models, clock, "bad")
    monkeypatch.setattr(specdec.tune.cli, "load_backend", lambda reference, *args, **kwargs: drafts[0].backend)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p.text) for p in _prompts(3)) + "\n")
    out = tmp_path / "out"
    args = build_parser().parse_args(["tune", "/models/target", "--drafts", "/models/bad", "--drafters", "draft_model",
                                      "--k-policies", "fixed", "--k-sweep", "2", "--prompts", str(prompts), "-n", "12",
                                      "--no-chat", "--no-plot", "--out", str(out)])
    try:
        code = run_tune_command(args, target=target, log=lambda message: None)
    finally:
        _remove(hooks)
    printed = capsys.readouterr().out
    assert code == 0
    assert "recommendation: do not speculate here: no configuration is shown faster than plain decoding" in printed
    assert f"wrote drafter none (plain decoding) to {out / 'tuned.json'}" in printed
    assert "warning: slower than plain decoding, do not use: /models/bad" in printed
    written = read_run_config(out / "tuned.json")
    assert written.spec.drafter == "none" and written.model.draft is None and not written.info["speculate"]
    report = json.loads((out / "tune.json").read_text())
    assert report["info"]["repeats"] == 2  # 3 prompts, repeated for at least 5 paired runs each
    assert report["rows"][0]["paired_runs"] == 6 and report["rows"][0]["speedup_interval"]["high"] < 1.0


def test_tune_command_refuses_bad_input_before_loading(capsys, tmp_path):
    for argv, message in (
        (["tune", "--drafters", "magic"], "unknown drafter"),
        (["tune", "--k-sweep", "0"], "--k-sweep"),
        (["tune", "--limit", "0"], "--limit"),
        (["tune", "--prompts", str(tmp_path / "missing.jsonl")], "cannot read prompts file"),
        (["tune", "--tasks", "poetry"], "unknown task"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_tune_on_llama_cpp_frees_each_runs_sequences(tmp_path, monkeypatch, capsys):
    """GGUF target and drafts on llama.cpp (what the default pair runs on); one configuration per run, so the
    24 engines made in all exceed the 16 sequences of a llama.cpp context unless each run frees its own."""
    pytest.importorskip("llama_cpp")
    import specdec.tune.run
    from tiny_gguf import write_tiny_gguf

    monkeypatch.setattr(specdec.tune.run, "MAX_CONFIGURATIONS_PER_RUN", 1)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    target = str(write_tiny_gguf(tmp_path / "target.gguf", seed=0, layers=2))
    draft = str(write_tiny_gguf(tmp_path / "draft.gguf", seed=1, layers=1))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps("def f(x):\n    return x + 1\n") + "\n" + json.dumps("for i in range(3): x") + "\n")
    code = main(["tune", target, "--drafts", f"{target},{draft}", "--drafters", "draft_model,prompt_lookup",
                 "--k-sweep", "2,3,4", "--prompts", str(prompts), "-n", "8", "--threads", "1", "--no-chat",
                 "--no-warmup", "--no-plot", "--repeats", "1", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    report = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert len(report["rows"]) == len(report["runs"]) == 3 * 4
    assert all(r["identical_to_plain"] for r in report["rows"])
    mine = [r for r in report["rows"] if r["draft"] == target and r["k_policy"] == "fixed"]
    assert mine and all(r["acceptance_rate"] == 1.0 for r in mine)  # the target as its own draft
    assert read_run_config(tmp_path / "out" / "tuned.json").model.backend == "auto"
