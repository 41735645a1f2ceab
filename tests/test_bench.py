"""`specdec bench` end to end on tiny random models and a tiny word-level tokenizer (no downloads)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from specdec.backends.pytorch.backend import TransformersBackend
from specdec.bench.datasets import HUMANEVAL_SIZE, load_humaneval, load_tasks, parse_tasks
from specdec.bench.method.methods import MethodOptions, resolve_methods
from specdec.bench.method.render import write_results
from specdec.bench.method.runner import BenchConfig, run_bench
from specdec.cli.main import build_parser, main
from specdec.config import ConfigError, SamplingParams
from specdec.decoder import SpecDecoder

VOCAB = 97
_WORDS = [
    "def", "return", "for", "in", "if", "else", "not", "and", "or", "is", "the", "a", "of", "to", "list", "numbers",
    "python", "function", "code", "import", "from", "typing", "List", "int", "str", "float", "bool", "True", "False",
    "None", "range", "len", "self", "(", ")", ":", ",", ".", "=", "+", "-", "*", "/", "[", "]", "<", ">", "\"\"\"",
    ">>>", "```", "user", "assistant", "system", "Complete", "following", "Reply", "with", "complete", "one", "block",
    "Add", "type", "hints", "every", "rewritten", "comment", "x", "y", "i", "n", "0", "1", "2", "result", "string",
    "given", "Check", "elements", "Return", "each", "line", "variables", "names", "keep", "unchanged",
]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1, "<unk>": 2, "<eos>": 3}
    for word in _WORDS:
        if word not in vocab and len(vocab) < VOCAB:
            vocab[word] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
    )
    fast.chat_template = (
        "{% for m in messages %}< {{ m['role'] }} > {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}< assistant > {% endif %}"
    )
    return fast


def tiny_model(seed: int, layers: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=3, bos_token_id=1, pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # peaked logits: argmax is never decided by float rounding
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def decoder(tokenizer):
    target = TransformersBackend(tiny_model(0, 3), tokenizer, name="tiny-target", max_context=1024)
    draft = TransformersBackend(tiny_model(1, 1), tokenizer, name="tiny-draft", max_context=1024)
    return SpecDecoder(target, draft)


def test_humaneval_loader_reads_the_packaged_file_and_respects_limit():
    problems = load_humaneval()
    assert len(problems) == HUMANEVAL_SIZE == 164
    assert problems[0]["task_id"] == "HumanEval/0" and "def " in problems[0]["prompt"]
    assert [p["task_id"] for p in load_humaneval(3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    prompts = load_tasks(["humaneval", "code_edit"], limit=2)
    assert [(p.task, p.id) for p in prompts] == [
        ("humaneval", "HumanEval/0"), ("humaneval", "HumanEval/1"),
        ("code_edit", "HumanEval/0"), ("code_edit", "HumanEval/1"),
    ]
    # The editing task hands the model the full solution, so the answer can copy it.
    edit = prompts[2]
    assert problems[0]["canonical_solution"].strip().splitlines()[0].strip() in edit.text
    assert len(load_tasks(["explain"], limit=1)) == 1
    with pytest.raises(ValueError, match="unknown task"):
        parse_tasks("humaneval,poetry")


def test_method_parsing_adds_baselines_and_refuses_unknown_names():
    options = MethodOptions(k_sweep=(2, 3))
    methods, _ = resolve_methods("spec,hf_assisted_k", options)
    names = [m.name for m in methods]
    assert names == ["plain", "spec_k2", "spec_k3", "hf_assisted_k2", "hf_assisted_k3", "hf_plain"]
    with pytest.raises(ConfigError, match="unknown method 'nonsense'"):
        resolve_methods("plain,nonsense", options)
    # Explicitly requested but impossible here: an error, not a silent skip.
    with pytest.raises(ConfigError, match="needs a draft model"):
        resolve_methods("spec_k2", options, has_draft_model=False)
    # A per-method maximum k for the adaptive drafters, so two maxima run side by side.
    methods, _ = resolve_methods("suffix_adaptive,suffix_adaptive_k16,prompt_lookup_adaptive_k3", options)
    by_name = {m.name: m for m in methods}
    assert by_name["suffix_adaptive"].spec.num_speculative_tokens == 32  # no --k-max: what generate uses
    assert by_name["suffix_adaptive_k16"].spec.num_speculative_tokens == 16
    assert by_name["suffix_adaptive_k16"].spec.k_policy == "adaptive"
    assert by_name["prompt_lookup_adaptive_k3"].spec.drafter == "prompt_lookup"
    with pytest.raises(ConfigError, match="k must be in"):
        resolve_methods("suffix_adaptive_k65", options)
    assert resolve_methods("adaptive", options)[0][1].spec.num_speculative_tokens == 5  # draft model, CPU
    on_gpu, _ = resolve_methods("adaptive,suffix_adaptive", MethodOptions(on_cuda=True))
    assert [m.spec.num_speculative_tokens for m in on_gpu if m.spec.drafter != "none"] == [16, 32]
    given, _ = resolve_methods("adaptive,suffix_adaptive", MethodOptions(k_max=7))
    assert [m.spec.num_speculative_tokens for m in given if m.spec.drafter != "none"] == [7, 7]
    # The default set only skips what cannot run.
    methods, skipped = resolve_methods(None, options, has_draft_model=False)
    assert "spec_k2" in skipped and "plain" in [m.name for m in methods]


def test_bench_end_to_end_writes_json_markdown_and_plot(decoder, tmp_path):
    prompts = load_tasks(["humaneval", "code_edit"], limit=1)
    methods, _skipped = resolve_methods(
        "plain,spec_k2,spec_k4,hf_plain,hf_assisted,hf_assisted_k3", MethodOptions(), has_draft_model=True,
    )
    config = BenchConfig(methods=methods, params=SamplingParams(max_tokens=8), extra={"weight_format": "fp32"})
    results = run_bench(decoder, prompts, config, log=lambda message: None)
    paths = write_results(results, tmp_path)

    data = json.loads(paths["json"].read_text())
    assert data["environment"]["torch"] == torch.__version__
    assert data["environment"]["transformers"] and data["environment"]["cpu_count"] >= 1
    assert data["environment"]["weight_format"] == "fp32"
    assert data["config"]["sampling"]["max_tokens"] == 8 and data["config"]["num_prompts"] == 2
    assert len(data["runs"]) == 2 * len(methods)
    overall = data["summary"]["overall"]
    assert set(overall) == {m.name for m in methods}
    assert overall["plain"]["speedup"] == 1.0
    for name in ("spec_k2", "spec_k4", "hf_assisted", "hf_assisted_k3"):
        row = overall[name]
        for key in ("tokens_per_second", "speedup", "acceptance_rate", "mean_acceptance_length",
                    "acceptance_rate_per_pos", "cost_ratio", "leviathan_bound"):
            assert row[key] is not None, (name, key)
        assert 0.0 <= row["acceptance_rate"] <= 1.0
        assert row["mean_acceptance_length"] >= 1.0
        # Greedy speculative decoding is lossless: token-for-token the plain output, on every prompt.
        assert row["identical_to_plain"] is True, name
    assert overall["spec_k4"]["k_for_bound"] == 4
    assert len(overall["spec_k4"]["acceptance_rate_per_pos"]) == 4
    assert overall["hf_assisted_k3"]["identical_to_hf_plain"] is True
    assert overall["hf_assisted_k3"]["speedup_vs_hf_plain"] is not None
    assert overall["hf_plain"]["identical_to_plain"] is True
    assert set(data["summary"]["per_task"]) == {"humaneval", "code_edit"}

    markdown = paths["markdown"].read_text()
    assert "| method | tok/s | prefill tok/s | decode tok/s | speedup vs plain | vs hf_plain |" in markdown
    assert "| method | humaneval | code_edit | overall" in markdown
    assert "incl. bonus" in markdown and "Leviathan" in markdown
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_same_model_as_draft_accepts_everything_in_ours_and_transformers(tokenizer):
    model = tiny_model(2, 2)
    target = TransformersBackend(model, tokenizer, name="t", max_context=1024)
    draft = TransformersBackend(copy.deepcopy(model), tokenizer, name="d", max_context=1024)
    methods, _ = resolve_methods("plain,spec_k3,hf_assisted_k3", MethodOptions(), has_draft_model=True)
    config = BenchConfig(methods=methods, params=SamplingParams(max_tokens=9, ignore_eos=True), warmup=False)
    results = run_bench(SpecDecoder(target, draft), load_tasks(["code_edit"], limit=1), config,
                        log=lambda message: None)
    overall = results["summary"]["overall"]
    for name in ("spec_k3", "hf_assisted_k3"):
        assert overall[name]["acceptance_rate"] == 1.0, name
        assert overall[name]["generated_tokens"] == 9
        assert overall[name]["identical_to_plain"] is True
    assert overall["spec_k3"]["mean_acceptance_length"] == 4.0  # k accepted + the bonus token


def test_cli_bench_runs_on_a_given_decoder(decoder, tmp_path, capsys):
    from specdec.bench.cli import run_bench_command

    args = build_parser().parse_args([
        "bench", "--weight-format", "fp32", "--limit", "1", "--tasks", "code_edit", "--max-tokens", "6",
        "--methods", "plain,spec_k2,hf_assisted", "--no-warmup", "--no-plot", "--out", str(tmp_path / "res"),
    ])
    assert run_bench_command(args, decoder=decoder, log=lambda message: None) == 0
    printed = capsys.readouterr().out
    assert "| spec_k2 |" in printed and "| hf_assisted |" in printed and "| hf_plain |" in printed
    assert (tmp_path / "res" / "results.json").exists() and not (tmp_path / "res" / "bench.png").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "plain,warp_drive"], "unknown method 'warp_drive'"),
        (["--tasks", "poetry"], "unknown task 'poetry'"),
        (["--k-sweep", "2,x"], "--k-sweep"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--threads", "1,0"], "--threads must be a positive integer"),
        (["--threads", "two"], "--threads must be a positive integer"),
        (["--prompts", "/nonexistent/q.jsonl"], "cannot read prompts file"),
        (["--load-format", "dummy", "--threads", "1,2"], "the GPU bench takes one --threads count"),
        (["--backend", "torch", "--methods", "plain,exact_adaptive"], "need the llama.cpp backend"),
        (["--exact", "--methods", "plain,exact_plain"], "--exact already puts every method on the exact kernels"),
        (["--methods", "exact_hf_plain"], "no exact mode"),
    ],
)
def test_cli_argument_errors_exit_2_before_loading_models(argv, message, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("models must not be loaded for a bad argument")

    monkeypatch.setattr(SpecDecoder, "load", classmethod(no_loading))
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "specdec bench: error:" in err and "Traceback" not in err


def test_cli_bad_argument_type_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--limit", "many"])
    assert exit_info.value.code == 2


def test_a_greedy_mismatch_is_reported_with_where_and_which_tokens(decoder, tmp_path, monkeypatch):
    from specdec.bench.method.runner import BenchRunner

    original = BenchRunner.run_method

    def corrupted(self, method, prompt_ids, params):
        outcome = original(self, method, prompt_ids, params)
        if method.name == "spec_k2" and len(outcome.tokens) > 2:
            outcome.tokens[2] = (outcome.tokens[2] + 1) % VOCAB
        return outcome

    monkeypatch.setattr(BenchRunner, "run_method", corrupted)
    methods, _ = resolve_methods("plain,spec_k2", MethodOptions(), has_draft_model=True)
    config = BenchConfig(methods=methods, params=SamplingParams(max_tokens=6, ignore_eos=True), warmup=False)
    results = run_bench(decoder, load_tasks(["humaneval"], limit=1), config, log=lambda message: None)
    row = results["summary"]["overall"]["spec_k2"]
    assert row["identical_to_plain"] is False and row["num_identical_to_plain"] == "0/1"
    run = next(r for r in results["runs"] if r["method"] == "spec_k2")
    assert run["mismatch_to_plain"]["index"] == 2 and len(run["tokens"]) == 6
    markdown = write_results(results, tmp_path, plot=False)["markdown"].read_text()
    assert "**Warning:** greedy output differs" in markdown and "| humaneval/HumanEval/0 | spec_k2 | plain | 2 |" in markdown
