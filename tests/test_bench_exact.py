"""The bench's exact_ methods: our methods on a second llama.cpp target with the exact kernels (--exact), in the
same interleaved run as the default ones. Method names, when the exact target is loaded (once, only when asked,
freed per thread count), greedy identity to exact_plain on tiny GGUF models (with the fast kernels' near-tie
flips on the same model as the negative control), and the report's wording for the two kinds of difference."""

from __future__ import annotations

import json

import pytest

from specdec.bench.method.aggregate import summarise
from specdec.bench.method.methods import EXACT_BASELINE, MethodOptions, resolve_methods
from specdec.bench.method.render import exact_table, to_markdown, to_markdown_by_threads
from specdec.cli.main import main
from specdec.config import ConfigError, SamplingParams, SpecConfig
from specdec.decoder import SpecDecoder

# prompt_lookup at a fixed k drafts at every match; its adaptive policy scores the copies first and, on this tiny
# model's output, rightly never drafts, which would leave its identity check nothing to verify.
OURS = ("plain", "adaptive", "prompt_lookup", "hybrid_adaptive", "spec_k3")


# -- method names -----------------------------------------------------------------------------------------

def test_exact_names_are_our_methods_on_the_exact_kernels_with_exact_plain_as_their_baseline():
    options = MethodOptions(k_sweep=(2, 3), k_max=5)
    methods, _ = resolve_methods(
        "adaptive,exact_adaptive,exact_prompt_lookup_adaptive,exact_hybrid_adaptive,exact_spec", options)
    by_name = {m.name: m for m in methods}
    assert list(by_name) == ["plain", "adaptive", "exact_adaptive", "exact_prompt_lookup_adaptive",
                             "exact_hybrid_adaptive", "exact_spec_k2", "exact_spec_k3", "exact_plain"]
    for name, method in by_name.items():
        exact = name.startswith("exact_")
        assert method.exact is exact and method.kind == "specdec"
        assert method.baseline == (EXACT_BASELINE if exact else "plain")
        assert method.to_dict()["exact"] is exact
    # The same decoding as the method without the prefix, only on the other target.
    assert by_name["exact_adaptive"].spec == by_name["adaptive"].spec
    assert by_name["exact_adaptive"].spec == SpecConfig(drafter="draft_model", num_speculative_tokens=5,
                                                        k_policy="adaptive")
    assert by_name["exact_plain"].spec.drafter == "none" and by_name["exact_plain"].is_plain
    assert by_name["exact_hybrid_adaptive"].requires == "specdec.kpolicy.adaptive"
    assert by_name["exact_spec_k3"].needs_draft_model and not by_name["exact_prompt_lookup_adaptive"].needs_draft_model


@pytest.mark.parametrize("name, message", [
    ("exact_nonsense", "unknown method 'exact_nonsense'"),
    ("exact_", "unknown method 'exact_'"),
    ("exact_exact_plain", "unknown method 'exact_exact_plain'"),
    ("exact_llamacpp_plain", "no exact mode"),
    ("exact_hf_assisted", "no exact mode"),
])
def test_exact_of_anything_but_our_methods_is_refused(name, message):
    with pytest.raises(ConfigError, match=message):
        resolve_methods(f"plain,{name}", MethodOptions())


def test_exact_methods_that_cannot_run_are_an_error_when_named_and_never_in_the_default_set():
    options = MethodOptions()
    why = "the torch backend has one set of kernels"
    with pytest.raises(ConfigError, match=f"'exact_adaptive' cannot run: {why}"):
        resolve_methods("plain,exact_adaptive", options, has_draft_model=True, exact_missing=why)
    with pytest.raises(ConfigError, match=f"'exact_spec_k2' cannot run: {why}"):
        resolve_methods("exact_spec", MethodOptions(k_sweep=(2,)), has_draft_model=True, exact_missing=why)
    # Negative control: without exact_ methods the reason matters to nothing.
    methods, skipped = resolve_methods(None, options, has_draft_model=True, exact_missing=why)
    assert not any(m.exact for m in methods) and not skipped
    methods, _ = resolve_methods("plain,exact_adaptive", options, has_draft_model=True)
    assert [m.name for m in methods] == ["plain", "exact_adaptive", "exact_plain"]


# -- on tiny GGUF models ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from tiny_gguf import quantize_q4_k_m, write_tiny_gguf

    root = tmp_path_factory.mktemp("exact")
    # Q4_K with rows of 256: the repacked kernels the fast mode takes and the exact mode slices around. Logits
    # less peaked than the other tests' (scale 4), so the fast kernels' rounding can flip near-ties. The draft is
    # the same weights unquantized: it is often right, and often not.
    wide = write_tiny_gguf(root / "wide.gguf", seed=3, hidden=256, ffn=512, scale=4.0)
    return {"target": quantize_q4_k_m(wide, root / "wide-q4_k_m.gguf"), "draft": wide,
            "small": write_tiny_gguf(root / "small.gguf", seed=0), "small_draft": write_tiny_gguf(
                root / "small-draft.gguf", seed=1, layers=1)}


class _Ids:
    """Prompts are token ids written as words (the tiny GGUF backends carry no tokenizer here)."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [int(w) for w in text.split()]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _decoder(target_path, draft_path, threads=2):
    from specdec.backends.llamacpp.backend import LlamaCppBackend

    target = LlamaCppBackend(target_path, name="tiny-target", max_context=512, threads=threads,
                             batch_invariant=False)
    draft = LlamaCppBackend(draft_path, name="tiny-draft", max_context=512, threads=threads,
                            batch_invariant=False)
    decoder = SpecDecoder(target, draft)
    decoder.tokenizer = _Ids()
    return decoder


def _prompts(count):
    from specdec.bench.datasets import BenchPrompt

    prompts = []
    for p in range(count):
        ids = [(i * 37 + p * 11) % 280 for i in range(10 + p)]
        ids += ids[:6]  # a repeat for prompt lookup to find
        text = " ".join(map(str, ids))
        prompts.append(BenchPrompt("humaneval" if p % 2 else "qa", f"p{p}", text, text))
    return prompts


@pytest.fixture()
def backend_log(monkeypatch):
    """Every LlamaCppBackend made or closed while the test runs: (event, batch_invariant, threads, file)."""
    from specdec.backends.llamacpp.backend import LlamaCppBackend

    log = []
    original_init, original_close = LlamaCppBackend.__init__, LlamaCppBackend.close

    def init(self, path, **kwargs):
        original_init(self, path, **kwargs)
        log.append(("open", self.batch_invariant, self.threads, str(path)))

    def close(self):
        log.append(("close", self.batch_invariant, self.threads, str(self.gguf_path)))
        original_close(self)

    monkeypatch.setattr(LlamaCppBackend, "__init__", init)
    monkeypatch.setattr(LlamaCppBackend, "close", close)
    return log


def _bench(decoder, names, prompts, max_tokens=40, warmup=True):
    from specdec.bench.method.runner import BenchConfig, run_bench

    methods, _ = resolve_methods(",".join(names), MethodOptions(k=3, k_max=5), has_draft_model=True)
    config = BenchConfig(methods=methods, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         chat=False, warmup=warmup, extra={"weight_format": "GGUF"})
    return run_bench(decoder, prompts, config, log=lambda message: None)


def test_exact_methods_are_identical_to_exact_plain_where_the_fast_ones_flip_near_ties(ggufs, backend_log):
    decoder = _decoder(ggufs["target"], ggufs["draft"])
    names = [*OURS, *(f"exact_{name}" for name in OURS)]
    results = _bench(decoder, names, _prompts(8))
    overall = results["summary"]["overall"]
    assert set(overall) == set(names)
    for name in OURS:
        exact = overall[f"exact_{name}"]
        if name != "plain":
            # The check: token for token exact_plain's output, on every prompt ...
            assert exact["identical_to_exact_plain"] is True and exact["num_identical_to_exact_plain"] == "8/8", name
            assert exact["speedup_vs_exact_plain"] is not None
        assert exact.get("identical_to_plain") is None  # ... and not held to plain, which runs other kernels
        assert overall[name].get("identical_to_exact_plain") is None
    # ... where drafts were both accepted and rejected, so verification really decided something.
    assert 0 < overall["exact_spec_k3"]["acceptance_rate"] < 1
    assert overall["exact_prompt_lookup"]["num_draft_tokens"] > 0
    # Negative control: the same methods on the fast kernels of the same model part from plain at near-ties,
    # so the comparison above can see a difference when there is one.
    flips = results["summary"]["greedy_differences"]["near_tie_flips"]
    assert all(not e["method"].startswith("exact_") for e in flips.values())
    if not decoder.target.amx:
        # (On an AMX library the tiny model's fast rows change only from 8 rows a pass, beyond these drafts
        # of k <= 5: no flips to see there. The injected mismatch below is the control that holds everywhere.)
        assert flips and sum(e["prompts"] for e in flips.values()) > 0
    assert not results["summary"]["greedy_differences"]["exact_mismatches"]
    # One exact target, made for the exact_ methods and freed at the end; the draft is shared.
    target = str(ggufs["target"])
    assert [e for e in backend_log if e[1]] == [("open", True, 2, target), ("close", True, 2, target)]
    env = results["environment"]
    assert env["exact_target"]["batch_invariant"] is True and env["target"]["batch_invariant"] is False
    assert env["exact_target"]["gguf"] == env["target"]["gguf"]
    assert env["exact_target"]["max_context"] == env["target"]["max_context"] == 512
    # The report: exact beside the default, the flips as information, no warning.
    pairs = results["summary"]["exact_vs_default"]
    assert set(pairs) == {f"exact_{name}" for name in OURS}
    assert pairs["exact_adaptive"]["default"] == "adaptive"
    assert pairs["exact_adaptive"]["overall"]["ratio"] == pytest.approx(
        overall["exact_adaptive"]["tokens_per_second"] / overall["adaptive"]["tokens_per_second"], abs=1e-3)
    markdown = to_markdown(results)
    assert "## --exact beside the default kernels" in markdown
    assert "| **greedy identical to exact_plain** |" in markdown and "8/8" in markdown
    assert "**Warning:**" not in markdown
    if flips:  # reported as information, not as a bug
        assert "Near-tie flips of the fast kernels (information, not a bug)" in markdown
        assert "near-tie flip (fast kernels)" in markdown


def test_a_difference_in_exact_mode_is_a_warning(ggufs, backend_log, monkeypatch):
    from specdec.bench.method.runner import BenchRunner

    original = BenchRunner.run_method

    def corrupted(self, method, prompt_ids, params):
        outcome = original(self, method, prompt_ids, params)
        if method.name == "exact_spec_k3" and len(outcome.tokens) > 4:
            outcome.tokens[4] = (outcome.tokens[4] + 1) % 280
        return outcome

    monkeypatch.setattr(BenchRunner, "run_method", corrupted)
    decoder = _decoder(ggufs["small"], ggufs["small_draft"], threads=1)
    results = _bench(decoder, ["spec_k3", "exact_spec_k3"], _prompts(2), max_tokens=8, warmup=False)
    row = results["summary"]["overall"]["exact_spec_k3"]
    assert row["identical_to_exact_plain"] is False and row["num_identical_to_exact_plain"] == "0/2"
    mismatches = results["summary"]["greedy_differences"]["exact_mismatches"]
    assert mismatches["exact_spec_k3 vs exact_plain"]["first_positions"] == [4, 4]
    markdown = to_markdown(results)
    assert "**Warning:** exact-mode greedy output differs from `exact_plain` for: `exact_spec_k3` vs exact_plain " \
           "2/2 prompts (first differing token at 4, 4)" in markdown
    assert "| exact_spec_k3 | exact_plain | 4 |" in markdown and "**bug**: exact mode |" in markdown


def test_without_exact_methods_no_exact_target_is_loaded(ggufs, backend_log):
    decoder = _decoder(ggufs["small"], ggufs["small_draft"], threads=1)
    backend_log.clear()
    results = _bench(decoder, ["plain", "spec_k3"], _prompts(1), max_tokens=4, warmup=False)
    assert backend_log == [] and "exact_target" not in results["environment"]
    assert "--exact beside" not in to_markdown(results)


def test_each_thread_count_loads_its_own_exact_target_and_frees_it_before_the_next(ggufs, backend_log, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"def f{i}(x): return x"]})
                                 + "\n" for i, c in enumerate(("qa", "rag"))))
    out = tmp_path / "res"
    target, draft = str(ggufs["small"]), str(ggufs["small_draft"])
    code = main(["bench", target, "--draft", draft, "--prompts", str(questions), "--threads", "1,2",
                 "--methods", "plain,adaptive,exact_adaptive", "--max-tokens", "4", "--no-warmup", "--no-plot",
                 "--out", str(out)])
    assert code == 0
    assert backend_log == [
        ("open", False, 1, target), ("open", False, 1, draft), ("open", True, 1, target), ("close", True, 1, target),
        ("open", False, 2, target), ("open", False, 2, draft), ("open", True, 2, target), ("close", True, 2, target),
    ]
    for n in (1, 2):
        data = json.loads((out / f"threads-{n}" / "results.json").read_text())
        assert {m["name"] for m in data["config"]["methods"]} == {"plain", "adaptive", "exact_adaptive",
                                                                  "exact_plain"}
        assert data["environment"]["exact_target"]["threads"] == n
        assert data["summary"]["overall"]["exact_adaptive"]["identical_to_exact_plain"] is True
    markdown = (out / "results.md").read_text()
    assert "## --exact beside the default kernels, per thread count" in markdown
    assert "| exact_adaptive | " in markdown


# -- refusals -------------------------------------------------------------------------------------------------

def test_exact_methods_on_the_torch_backend_are_a_config_error(tmp_path):
    from specdec.backends.pytorch.backend import TransformersBackend
    from specdec.bench.cli import run_bench_command
    from specdec.bench.method.runner import BenchConfig, BenchRunner
    from specdec.cli.main import build_parser
    from test_bench import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    decoder = SpecDecoder(TransformersBackend(tiny_model(0, 2), tokenizer, name="t", max_context=256),
                          TransformersBackend(tiny_model(1, 1), tokenizer, name="d", max_context=256))
    args = build_parser().parse_args(["bench", "--limit", "1", "--tasks", "code_edit", "--methods",
                                      "plain,exact_adaptive", "--no-plot", "--out", str(tmp_path / "res")])
    with pytest.raises(ConfigError, match="'exact_adaptive' cannot run: the exact_ methods compare llama.cpp's"):
        run_bench_command(args, decoder=decoder, log=lambda message: None)
    methods, _ = resolve_methods("exact_plain", MethodOptions(), has_draft_model=True)
    with pytest.raises(ConfigError, match="torch backend has one set of kernels"):
        BenchRunner(decoder, BenchConfig(methods=methods))


def test_exact_methods_beside_an_exact_target_are_a_config_error(ggufs):
    from specdec.backends.llamacpp.backend import LlamaCppBackend
    from specdec.bench.method.exact import exact_missing_reason, load_exact_decoder

    exact = LlamaCppBackend(ggufs["small"], max_context=64, threads=1, batch_invariant=True)
    assert "already runs the exact kernels" in exact_missing_reason(exact)
    with pytest.raises(ConfigError, match="already runs the exact kernels"):
        load_exact_decoder(SpecDecoder(exact))
    fast = LlamaCppBackend(ggufs["small"], max_context=64, threads=1, batch_invariant=False)
    assert exact_missing_reason(fast) is None  # negative control


# -- the report's wording, on synthetic runs ----------------------------------------------------------------

def _synthetic(target_env: dict, flags: dict[str, list]) -> dict:
    """Runs of two tasks; flags[method] = per-prompt (baseline, first differing token or None)."""
    from test_bench_chat import _run

    names = list(flags)
    methods, _ = resolve_methods(",".join(names), MethodOptions(), has_draft_model=True)
    runs = []
    rates = {"plain": 10.0, "adaptive": 12.0, "exact_plain": 8.0, "exact_adaptive": 9.0}
    for name in [m.name for m in methods]:
        for p, (task, prompt_id) in enumerate((("A", "1"), ("B", "2"))):
            run = _run(name, task, prompt_id, rates.get(name, 10.0))
            for baseline, index in flags.get(name, [])[p:p + 1]:
                run[f"identical_to_{baseline}"] = index is None
                if index is not None:
                    run[f"first_mismatch_to_{baseline}"] = index
                    run[f"mismatch_to_{baseline}"] = {"index": index, "method_token": 1, "baseline_token": 2,
                                                      "method_text": "a", "baseline_text": "b"}
            runs.append(run)
    results = {
        "config": {"methods": [m.to_dict() for m in methods], "num_prompts": 2, "repeats": 1, "chat": True,
                   "sampling": {"greedy": True, "max_tokens": 100, "ignore_eos": True}},
        "environment": {"cpu_count": 2, "torch": "x", "transformers": "y", "torch_threads": 1,
                        "target": target_env},
        "runs": runs,
    }
    results["summary"] = summarise(results)
    return results


FAST = {"name": "t", "backend": "llama.cpp", "batch_invariant": False, "threads": 2}
EXACT = {**FAST, "batch_invariant": True}
FLAGS = {
    "plain": [],
    "adaptive": [("plain", 17), ("plain", None)],  # one prompt flipped at token 17
    "exact_plain": [],
    "exact_adaptive": [("exact_plain", None), ("exact_plain", None)],
}


def test_fast_kernel_differences_are_information_and_exact_ones_a_warning():
    results = _synthetic(FAST, FLAGS)
    differences = results["summary"]["greedy_differences"]
    assert differences["near_tie_flips"] == {"adaptive vs plain": {
        "method": "adaptive", "baseline": "plain", "prompts": 1, "of": 2, "first_positions": [17]}}
    assert not differences["exact_mismatches"] and not differences["unexpected"]
    markdown = to_markdown(results)
    assert ("Near-tie flips of the fast kernels (information, not a bug): greedy output differs from `plain` "
            "for `adaptive` 1/2 prompts (first differing token at 17)") in markdown
    assert "**Warning:**" not in markdown
    assert "| no: near-tie flips (1/2) |" in markdown  # the method table's identity cell, not **NO**
    assert "| A/1 | adaptive | plain | 17 | `'a'` (1) | `'b'` (2) | near-tie flip (fast kernels) |" in markdown
    # An exact method that differs from exact_plain is a bug, whatever the main target's kernels.
    broken = _synthetic(FAST, {**FLAGS, "exact_adaptive": [("exact_plain", None), ("exact_plain", 3)]})
    markdown = to_markdown(broken)
    assert ("**Warning:** exact-mode greedy output differs from `exact_plain` for: `exact_adaptive` vs "
            "exact_plain 1/2 prompts (first differing token at 3)") in markdown
    assert markdown.index("**bug**: exact mode") < markdown.index("near-tie flip (fast kernels)")  # bugs first
    # Negative control: the same difference from plain on exact kernels (--exact, or torch) stays a warning.
    for env in (EXACT, {"name": "t", "backend": "torch"}):
        markdown = to_markdown(_synthetic(env, FLAGS))
        assert "**Warning:** greedy output differs from the baseline for: `adaptive` 1/2 prompts" in markdown
        assert "Near-tie flips" not in markdown and "| **NO** (1/2) |" in markdown


def test_the_exact_table_puts_each_exact_rate_beside_the_default_per_task_and_overall():
    results = _synthetic(FAST, FLAGS)
    table = exact_table(results["summary"])
    lines = table.splitlines()
    assert lines[0] == "| task | plain | exact_plain | exact/default | adaptive | exact_adaptive | exact/default |"
    assert "| A | 10.00 | 8.00 | 0.80x | 12.00 | 9.00 | 0.75x |" in lines
    assert "| **overall** | 10.00 | 8.00 | 0.80x | 12.00 | 9.00 | 0.75x |" in lines
    assert lines[-1] == "| **greedy identical to exact_plain** | | baseline | | | 2/2 | |"
    # Negative control: no exact_ methods, no table.
    assert exact_table(_synthetic(FAST, {"plain": [], "adaptive": []})["summary"]) == ""
    overview = to_markdown_by_threads({1: results, 2: _synthetic(FAST, FLAGS)})
    assert "| exact_adaptive | 12.00 | 9.00 | 0.75x | 2/2 | 12.00 | 9.00 | 0.75x | 2/2 |" in overview
