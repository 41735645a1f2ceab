"""The `specdec` console script: bad input gives a one-line error and a non-zero exit (no traceback); a tiny
model pair runs end to end with --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import save_tiny_model, tiny_llama, tiny_tokenizer
from specdec.cli.main import build_parser, main


def _env(tmp_path) -> dict:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "SPECDEC_CACHE": str(tmp_path / "cache"), "PYTHONWARNINGS": "ignore",
                "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
    return env


def _spawn(args, tmp_path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "specdec.cli.main", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_env(tmp_path), cwd=str(tmp_path),
    )


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A target and a perturbed-copy draft saved with a shared word-level tokenizer (Llama: see conftest)."""
    root = tmp_path_factory.mktemp("cli-models")
    tokenizer = tiny_tokenizer()
    target = tiny_llama(seed=0)
    draft = tiny_llama(seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.2 * p.std())
    save_tiny_model(root / "draft-other-vocab", tiny_llama(seed=2), tiny_tokenizer(word="v"))
    (root / "notes.txt").write_text("not a model")
    (root / "empty-dir").mkdir()
    return save_tiny_model(root / "target", target, tokenizer), save_tiny_model(root / "draft", draft, tokenizer), root


# name: (arguments, words the one-line message must contain)
SUBPROCESS_BAD_INPUTS = {  # through a fresh `python -m specdec.cli.main`, exactly as a user runs it
    "missing_gguf": (["generate", "{root}/missing-model.gguf"], ["model file not found", "missing-model.gguf"]),
    "negative_temperature": (["generate", "{target}", "--temperature", "-1"], ["temperature", "-1"]),
    "k_zero": (["generate", "{target}", "--draft", "{draft}", "-k", "0"], ["num_speculative_tokens", "0"]),
    "negative_max_tokens": (["generate", "{target}", "--max-tokens", "-5"], ["max_tokens", "-5"]),
}
IN_PROCESS_BAD_INPUTS = {  # through main() in this process (same code path, no interpreter start-up)
    "garbage_model": (["generate", "not a model at all"], ["model not found", "hub id"]),
    "dir_without_config": (["generate", "{root}/empty-dir"], ["no config.json"]),
    "text_file_model": (["generate", "{root}/notes.txt"], ["not a .gguf"]),
    "nan_temperature": (["generate", "{target}", "--temperature", "nan"], ["temperature"]),
    "bad_top_p": (["generate", "{target}", "--top-p", "0"], ["top_p"]),
    "bad_draft_p_min": (["generate", "{target}", "--draft-p-min", "1.5"], ["draft_p_min"]),
    "small_context": (["generate", "{target}", "--max-context", "4"], ["max_context"]),
    "missing_prompt_file": (["generate", "{target}", "--prompt-file", "{root}/nope.txt"], ["cannot read prompt file"]),
    "bad_vocab_draft": (["generate", "{target}", "--draft", "{root}/draft-other-vocab"], ["different vocabularies"]),
    "prompt_too_long": (
        ["generate", "{target}", "--draft", "{draft}", "--max-context", "16", "--max-tokens", "8", "--no-chat",
         "--prompt", " ".join(["w5"] * 12)],
        ["prompt (12 tokens) + max_tokens (8)", "exceeds", "16"],  # the user's numbers, not a warm-up's
    ),
}


def _fill(args, tiny_pair):
    target, draft, root = tiny_pair
    return [a.format(target=target, draft=draft, root=str(root)) for a in args]


@pytest.fixture(scope="module")
def bad_runs(tiny_pair, tmp_path_factory):
    """Start every subprocess case at once (each is a fresh interpreter); collect (exit code, stdout, stderr)."""
    tmp = tmp_path_factory.mktemp("cli-runs")
    procs = {name: _spawn(_fill(args, tiny_pair), tmp) for name, (args, _) in SUBPROCESS_BAD_INPUTS.items()}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[name] = (proc.returncode, out, err)
    return results


def check_one_line_error(code, out, err, words):
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and "Traceback" not in out, err
    # Nothing before the error either: no progress bar of a load that took milliseconds (specdec.loading.progress).
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("specdec generate: error: "), lines[0]
    assert err.rstrip().splitlines()[-1] == lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize("name", list(SUBPROCESS_BAD_INPUTS))
def test_bad_input_subprocess_gives_one_clear_line(bad_runs, name):
    check_one_line_error(*bad_runs[name], SUBPROCESS_BAD_INPUTS[name][1])


@pytest.mark.parametrize("name", list(IN_PROCESS_BAD_INPUTS))
def test_bad_input_gives_one_clear_line(tiny_pair, name, capsys):
    _target, _draft, _root = tiny_pair
    args, words = IN_PROCESS_BAD_INPUTS[name]
    code = main(_fill(args, tiny_pair))
    captured = capsys.readouterr()
    check_one_line_error(code, captured.out, captured.err, words)


@pytest.mark.parametrize(
    "args,fragment",
    [(["generate", "x", "--temperature", "abc"], "invalid float value"), (["generate", "x", "-k", "two"], "invalid int"),
     (["generate", "x", "--weight-format", "int4"], "invalid choice"), (["frobnicate"], "invalid choice")],
)
def test_argparse_errors_exit_2_with_a_clear_last_line(args, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert fragment in err.strip().splitlines()[-1]


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("specdec ")


def test_generate_json_end_to_end(tiny_pair, tmp_path):
    target, draft, _ = tiny_pair
    proc = _spawn(
        ["generate", target, "--draft", draft, "--max-tokens", "8", "--no-chat", "--json", "-k", "3", "--k-policy", "fixed",
         "--prompt", "w5 w6 w7 w8", "--ignore-eos"],
        tmp_path,
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    report = json.loads(out)
    stats = report["stats"]
    assert stats["num_generated_tokens"] == 8 and report["finish_reason"] == "length"
    assert report["prompt_tokens"] == 4
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    assert stats["num_draft_tokens"] > 0
    assert stats["acceptance_rate"] == pytest.approx(stats["num_accepted_tokens"] / stats["num_draft_tokens"], abs=1e-3)
    assert stats["mean_acceptance_length"] >= 1.0
    assert isinstance(report["speedup"], float) and report["speedup"] > 0
    assert report["identical_to_plain"] is True
    assert report["plain"]["num_generated_tokens"] == 8
    assert report["spec"] == {"drafter": "draft_model", "k": 3, "k_policy": "fixed", "why": "the default with a draft model"}
    assert "cost_ratio" in report and "leviathan_bound" in report
    words = report["text"].split()  # special tokens are skipped when decoding; the rest are w<id>
    assert 0 < len(words) <= 8 and all(w.startswith("w") for w in words), report["text"]


def test_generate_human_report_and_stream_in_process(tiny_pair, capsys):
    target, draft, _ = tiny_pair
    code = main(["generate", target, "--draft", draft, "--max-tokens", "6", "--no-chat", "--prompt", "w9 w10",
                 "--stream", "--ignore-eos", "--weight-format", "fp32", "--k-policy", "fixed"])
    assert code == 0
    out = capsys.readouterr().out
    assert "acceptance rate" in out and "speedup" in out and "greedy identical     yes" in out
    assert "mean accept. length" in out and "incl. bonus" in out
    code = main(["generate", target, "--draft", draft, "--max-tokens", "4", "--no-chat", "--prompt", "w9 w10",
                 "--no-compare", "--temperature", "0.8", "--seed", "3", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert "speedup" not in report and report["stats"]["num_generated_tokens"] <= 4


def test_without_a_draft_model_the_default_drafter_is_suffix(tiny_pair, capsys):
    target, _draft, _ = tiny_pair
    code = main(["generate", target, "--max-tokens", "3", "--no-chat", "--prompt", "w9 w10", "--json"])
    assert code == 0
    spec = json.loads(capsys.readouterr().out)["spec"]
    assert spec["drafter"] == "suffix" and spec["why"] == "the default without a draft model (model-free)"
    # The default pair loads its draft model only where it can pay (CUDA) or when a drafter needs it.
    from specdec.cli.flags import model_ref_from_args

    assert model_ref_from_args(build_parser().parse_args(["generate", "--device", "cpu"])).draft is None
    for drafter in ("draft_model", "hybrid"):
        ref = model_ref_from_args(build_parser().parse_args(["generate", "--device", "cpu", "--drafter", drafter]))
        assert ref.draft == "default-draft"


def test_explicit_drafter_none_decodes_plainly(tiny_pair, capsys):
    """--drafter none (what a tuned config says when no draft pays) runs plain decoding instead of refusing."""
    target, _draft, _ = tiny_pair
    code = main(["generate", target, "--drafter", "none", "--max-tokens", "5", "--no-chat", "--prompt", "w9 w10",
                 "--ignore-eos", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["spec"]["drafter"] == "none" and "speedup" not in report
    assert report["stats"]["num_generated_tokens"] == 5 and report["stats"]["num_draft_tokens"] == 0


def test_request_that_exactly_fits_the_context_runs(tiny_pair, capsys):
    """14 prompt tokens + 1 new token in a 16-token context fits (the warm-up must not refuse it)."""
    target, draft, _ = tiny_pair
    code = main(["generate", target, "--draft", draft, "--max-context", "16", "--max-tokens", "1", "--no-chat",
                 "--json", "--prompt", " ".join(["w5"] * 14)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["prompt_tokens"] == 14 and report["stats"]["num_generated_tokens"] == 1


def test_backend_flags_reach_the_model_reference():
    from specdec.cli.flags import model_ref_from_args

    args = build_parser().parse_args(["generate", "m.gguf", "--backend", "llama.cpp", "--threads", "3", "--exact"])
    ref = model_ref_from_args(args)
    assert (ref.backend, ref.threads, ref.batch_invariant) == ("llama.cpp", 3, True)
    # Fast kernels by default; the old flag still parses and means the default.
    ref = model_ref_from_args(build_parser().parse_args(["generate", "m.gguf"]))
    assert (ref.backend, ref.threads, ref.batch_invariant, ref.weight_format) == ("auto", None, False, "fp32")
    ref = model_ref_from_args(build_parser().parse_args(["generate", "m.gguf", "--no-batch-invariance"]))
    assert ref.batch_invariant is False
    # A weight format is a torch conversion: under auto it selects torch.
    ref = model_ref_from_args(build_parser().parse_args(["generate", "m.gguf", "--weight-format", "int8"]))
    assert (ref.backend, ref.weight_format) == ("torch", "int8")


def test_a_command_whose_extra_is_missing_says_which_extra(monkeypatch, capsys):
    """Without the server extra, `specdec serve ...` names the extra in one line (exit 2); generate still works."""
    import builtins

    real_import = builtins.__import__

    def no_fastapi(name, *args, **kwargs):
        if name == "fastapi" or name.startswith("fastapi."):
            raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")
        return real_import(name, *args, **kwargs)

    import sys

    for module in [m for m in sys.modules if m.startswith(("specdec.server", "fastapi"))]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setattr(builtins, "__import__", no_fastapi)
    code = main(["serve", "default", "--port", "9", "--api-key", "k"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip() == ("specdec serve: error: 'specdec serve' needs the server extra (fastapi is not installed): "
                           "pip install 'specdec[server]'")
    with pytest.raises(SystemExit) as help_exit:  # the other commands are unaffected
        main(["generate", "--help"])
    assert help_exit.value.code == 0


# -- Ctrl-C and help ------------------------------------------------------------------------------------------

def test_the_console_script_imports_no_torch_before_main(tmp_path):
    """The `specdec` script imports specdec.cli.main before main() runs: torch there (seconds) would put a Ctrl-C
    outside main's handler, as a traceback. The torch-dependent names of `specdec` load on first use."""
    code = ("import sys, specdec.cli.main; assert 'torch' not in sys.modules, 'torch imported'; "
            "from specdec import SpecDecoder, SpecStats; assert SpecDecoder.__name__ == 'SpecDecoder'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(tmp_path))
    assert result.returncode == 0, result.stderr


def test_ctrl_c_while_the_parser_imports_the_commands_is_one_line(monkeypatch, capsys):
    import specdec.cli.main

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(specdec.cli.main, "build_parser", interrupted)
    assert main(["generate"]) == 130
    assert capsys.readouterr().err == "specdec: interrupted\n"


def test_ctrl_c_while_the_models_load_is_one_line(tiny_pair, monkeypatch, capsys):
    import specdec.decoder

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(specdec.decoder.SpecDecoder, "load", interrupted)
    assert main(["generate", tiny_pair[0], "--no-chat", "--prompt", "w9"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "specdec generate: interrupted\n" and captured.out == ""


def _interrupt_after(monkeypatch, chunks: int, max_tokens: int, plain: bool = False):
    """Ctrl-C after `chunks` chunks of the speculative stream (plain=False) or in the plain comparison run,
    for requests of max_tokens only (the warm-up runs are shorter)."""
    from specdec.engine.single import SpeculativeEngine

    stream, generate = SpeculativeEngine.stream, SpeculativeEngine.generate

    def interrupted_stream(self, prompt, params):
        if plain or params.max_tokens != max_tokens or self.drafter is None:
            yield from stream(self, prompt, params)
            return
        for number, chunk in enumerate(stream(self, prompt, params)):
            if number == chunks:
                raise KeyboardInterrupt
            yield chunk

    def interrupted_generate(self, prompt, params):
        if plain and params.max_tokens == max_tokens and self.drafter is None:
            raise KeyboardInterrupt
        return generate(self, prompt, params)

    monkeypatch.setattr(SpeculativeEngine, "stream", interrupted_stream)
    monkeypatch.setattr(SpeculativeEngine, "generate", interrupted_generate)


@pytest.mark.parametrize("stream", [False, True])
def test_ctrl_c_during_generation_prints_the_text_so_far(tiny_pair, monkeypatch, capsys, stream):
    target, draft, _ = tiny_pair
    argv = ["generate", target, "--draft", draft, "--max-tokens", "20", "--no-chat", "--prompt", "w9 w10",
            "--ignore-eos", "--k-policy", "fixed", "-k", "2"] + (["--stream"] if stream else [])
    assert main(argv) == 0
    full = capsys.readouterr().out.split("\n\nprompt tokens")[0].strip()
    _interrupt_after(monkeypatch, chunks=3, max_tokens=20)
    assert main(argv) == 130
    captured = capsys.readouterr()
    kept = captured.out.strip()
    assert kept and full.startswith(kept) and len(kept.split()) < len(full.split()), (kept, full)
    assert "acceptance rate" not in captured.out and "Traceback" not in captured.err
    assert captured.err.startswith("specdec generate: interrupted after ") and captured.err.count("\n") == 1
    assert "generated tokens; the text so far is printed" in captured.err


def test_ctrl_c_during_the_plain_comparison_keeps_the_whole_text(tiny_pair, monkeypatch, capsys):
    target, draft, _ = tiny_pair
    argv = ["generate", target, "--draft", draft, "--max-tokens", "12", "--no-chat", "--prompt", "w9 w10",
            "--ignore-eos"]
    _interrupt_after(monkeypatch, chunks=0, max_tokens=12, plain=True)
    assert main(argv + ["--json"]) == 130
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["interrupted"] and report["speculative_run_complete"] and report["generated_tokens"] == 12
    assert len(report["text"].split()) >= 1
    assert "during the plain-decoding comparison" in captured.err and captured.err.count("\n") == 1


def test_drafter_none_report_says_plain_decoding_not_speculative(tiny_pair, capsys):
    target, _draft, _ = tiny_pair
    assert main(["generate", target, "--drafter", "none", "--max-tokens", "3", "--no-chat", "--prompt", "w9"]) == 0
    out = capsys.readouterr().out
    assert "drafter              none: plain decoding" in out and "plain decoding       " in out
    assert "speculative" not in out and "adaptive policy" not in out


def test_every_flag_of_every_command_has_help():
    import argparse

    missing = []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, path + [name])
            elif action.help is None:
                missing.append(" ".join(path + [action.option_strings[0] if action.option_strings else action.dest]))

    walk(build_parser(), ["specdec"])
    assert missing == []
    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "target's weights" in " ".join(help_text.split())  # --weight-format: the target's, not both models'
