"""specdec distill on tiny models written in the test: losses against brute force, the target's top-K data aligned with
its continuation, distillation raising measured acceptance on held-out prompts (with zero-step and lr-0 negative
controls), the GGUF export against the torch model in the llama.cpp backend, and the CLI end to end."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import save_tiny_model, tiny_llama, tiny_qwen2, tiny_tokenizer
from specdec.backends.llamacpp.backend import LlamaCppBackend
from specdec.cli.main import main
from specdec.config import SamplingParams
from specdec.distill import (
    DistillOptions,
    TrainConfig,
    collect_examples,
    distill,
    export_gguf,
    load_trainable_draft,
    mean_divergence,
    split_prompt_file,
    split_task,
    train_draft,
)
from specdec.distill.losses import forward_kl, restrict_to_vocab, topk_log_probs, total_variation
from specdec.loading.models import check_vocab_compatible, load_backend
from tiny_gguf import VOCAB, write_tiny_gguf

WORDS = ["def", "return", "for", "in", "the", "x", "if", "else", "while", "list", "sum", "max", "min", "value",
         "count", "index"]
TRAIN, HELDOUT = 150, 12


def structured_target(seed: int = 0):
    """A random 2-layer Qwen2 whose residual branches are damped and whose LM head is scaled up.

    An undamped random transformer is a chaotic function of its whole context: nothing small imitates it from a
    few hundred sequences, on the training prompts or off them. Damped, its next token depends mostly on the
    last few tokens with peaked probabilities, as a real LM's often does; its weights are still random.
    """
    model = tiny_qwen2(seed=seed, layers=2, vocab=VOCAB)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
        model.lm_head.weight.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    vocab = write_tiny_gguf(root / "vocab.gguf", seed=5, layers=1)
    rng = random.Random(1)
    prompts = root / "prompts.jsonl"
    with open(prompts, "w", encoding="utf-8") as handle:
        for i in range(TRAIN + HELDOUT):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
            handle.write(json.dumps({"id": f"p{i}", "prompt": text}) + "\n")
    return {
        "root": root,
        "target": export_gguf(structured_target(), root / "target.gguf", vocab_gguf=vocab, kind="f32"),
        "draft": write_tiny_gguf(root / "draft.gguf", seed=1, layers=1),
        "prompts": prompts,
    }


@pytest.fixture(scope="module")
def target(files):
    return load_backend(str(files["target"]), role="target", max_context=512, threads=1)


# -- losses ----------------------------------------------------------------------------------------------------

def test_losses_equal_brute_force_on_the_full_vocabulary():
    torch.manual_seed(0)
    target_logits, draft_logits = torch.randn(5, 40) * 3, torch.randn(5, 40) * 3
    ids, log_p = topk_log_probs(target_logits, 8)
    assert torch.allclose(torch.logsumexp(log_p, -1), torch.zeros(5), atol=1e-6)  # renormalised over K
    p = torch.zeros(5, 40).scatter(-1, ids, log_p.exp())  # the sparse p the losses assume
    q = torch.softmax(draft_logits, -1)
    log_q = torch.log_softmax(draft_logits, -1)
    kl = (p * (torch.log(p.clamp_min(1e-30)) - log_q)).sum(-1).mean()
    tv = 0.5 * (p - q).abs().sum(-1).mean()
    assert torch.allclose(forward_kl(log_q, ids, log_p), kl, atol=1e-5)
    assert torch.allclose(total_variation(log_q, ids, log_p), tv, atol=1e-5)
    # q = p gives zero; a different q does not (the check above could pass with a loss that is always 0).
    log_q_equal = torch.log(p.clamp_min(1e-30))
    assert float(forward_kl(log_q_equal, ids, log_p)) < 1e-5
    assert float(total_variation(log_q_equal, ids, log_p)) < 1e-5
    assert float(forward_kl(log_q, ids, log_p)) > 0.1 and float(total_variation(log_q, ids, log_p)) > 0.1


def test_ids_the_draft_cannot_score_are_dropped_and_renormalised():
    ids = torch.tensor([[3, 50, 7]])
    log_p = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    restricted = restrict_to_vocab(ids, log_p, vocab=40)
    assert torch.allclose(restricted.exp(), torch.tensor([[0.5 / 0.7, 0.0, 0.2 / 0.7]]))
    log_q = torch.log_softmax(torch.randn(1, 40), -1)
    assert torch.isfinite(forward_kl(log_q, ids, restricted)) and torch.isfinite(total_variation(log_q, ids, restricted))


# -- data ------------------------------------------------------------------------------------------------------

def test_collected_top_k_rows_are_the_target_distributions_of_its_continuation(files, target):
    split = split_prompt_file(files["prompts"], HELDOUT)
    assert len(split.train) == TRAIN and [p.id for p in split.heldout] == [f"p{i}" for i in range(TRAIN, TRAIN + HELDOUT)]
    ids = [(p.id, list(target.tokenizer(p.text)["input_ids"])) for p in split.train[:6]]
    examples, skipped = collect_examples(target, ids, SamplingParams(max_tokens=16), top_k=16, progress=False)
    assert not skipped and len(examples) == 6
    for example in examples:
        n = len(example.continuation)
        assert example.topk_ids.shape == (n, 16) and example.topk_log_probs.shape == (n, 16)
        # Greedy: the top id of each row is the token the target chose there.
        assert example.topk_ids[:, 0].tolist() == example.continuation
        # Independent check: a fresh forward over prompt + continuation gives the same distributions.
        cache = target.new_cache()
        logits = target.forward(example.prompt + example.continuation[:-1], cache, num_logits=n)
        ref_ids, ref_log_p = topk_log_probs(logits, 16)
        assert torch.equal(ref_ids[:, 0], example.topk_ids[:, 0])
        assert torch.allclose(ref_log_p, example.topk_log_probs, atol=1e-3)
    too_long = [("long", list(range(5, 5 + 500)))]
    assert collect_examples(target, too_long, SamplingParams(max_tokens=16), progress=False) == ([], ["long"])


def test_task_split_holds_out_whole_problems_on_every_eval_task():
    split = split_task("humaneval", 14, ["humaneval", "code_edit"])
    train_ids = {p.id for p in split.train}
    assert len(split.train) == 150 and len(split.heldout) == 28
    assert {p.task for p in split.heldout} == {"humaneval", "code_edit"}
    assert not train_ids & {p.id for p in split.heldout}


# -- training and the measured acceptance -------------------------------------------------------------------------

def _distil(files, out, **train):
    split = split_prompt_file(files["prompts"], HELDOUT)
    options = DistillOptions(
        max_tokens=32, eval_max_tokens=24, threads=1, max_context=512,
        train=TrainConfig(**{"method": "full", "lr": 3e-3, "epochs": 3, "batch_size": 8, **train}),
    )
    report = distill(str(files["target"]), str(files["draft"]), split, out, options, log=lambda _: None,
                     progress=False)
    return report["comparison"]["overall"]["spec_k4"], report


def test_distillation_raises_acceptance_on_held_out_prompts(files, tmp_path):
    row, report = _distil(files, tmp_path / "trained")
    rate, length = row["acceptance_rate"], row["mean_acceptance_length"]
    assert rate["after"] > rate["before"] + 0.15, rate  # measured: 0.002 -> 0.31
    assert length["after"] > length["before"] + 0.5, length  # measured: 1.01 -> 2.21
    assert row["identical_to_plain"] == {"before": True, "after": True}
    assert report["training"]["loss_last"] < report["training"]["loss_first"]
    held = set(report["evaluation"]["heldout_prompt_ids"])
    assert held and not held & {f"prompts/{i}" for i in report["data"]["train_prompt_ids"]}
    for name in ("config.json", "model.safetensors", "draft.gguf", "report.md", "report.json", "distill-data.pt"):
        assert (tmp_path / "trained" / name).exists(), name
    assert f"{rate['before']:.3f} → {rate['after']:.3f}" in (tmp_path / "trained" / "report.md").read_text()


@pytest.mark.parametrize("control", [{"max_steps": 0}, {"lr": 0.0}], ids=["zero-steps", "lr-0"])
def test_no_training_leaves_acceptance_unchanged(files, tmp_path, control):
    row, report = _distil(files, tmp_path / "control", **control)
    assert row["acceptance_rate"]["after"] == row["acceptance_rate"]["before"]
    assert row["mean_acceptance_length"]["after"] == row["mean_acceptance_length"]["before"]
    assert (report["training"]["steps"] == 0) == ("max_steps" in control)


def test_lora_and_total_variation_also_lower_the_divergence(files, target):
    split = split_prompt_file(files["prompts"], HELDOUT)
    ids = [(p.id, list(target.tokenizer(p.text)["input_ids"])) for p in split.train[:60]]
    examples, _ = collect_examples(target, ids, SamplingParams(max_tokens=24), progress=False)
    for config in (TrainConfig(method="lora", lr=1e-2, epochs=2, batch_size=8),
                   TrainConfig(method="full", loss="tvd", lr=3e-3, epochs=2, batch_size=8, dtype="bf16")):
        model, _ = load_trainable_draft(str(files["draft"]), config.dtype)
        before = mean_divergence(model, examples, config.loss)
        model, result = train_draft(model, examples, config, progress=False)
        assert result.steps == 16 and result.trainable_parameters > 0
        assert mean_divergence(model, examples, config.loss) < before - 0.05, config
        assert not hasattr(model, "peft_config")  # LoRA merged: a plain model that saves like the input


# -- GGUF export ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_exported_gguf_runs_in_llamacpp_with_the_torch_models_logits(files, tmp_path, arch):
    if arch == "qwen2":  # from a GGUF: its metadata is copied
        model, source = load_trainable_draft(str(files["draft"]))
        path = export_gguf(model, tmp_path / "draft.gguf", source_gguf=source, kind="f32")
    else:  # from a transformers model: config + the target's vocabulary; q/k permuted to llama.cpp's layout
        model = tiny_llama(seed=3, vocab=VOCAB)
        path = export_gguf(model, tmp_path / "draft.gguf", vocab_gguf=files["target"], kind="f32")
    backend = LlamaCppBackend(path, max_context=256, threads=1)
    tokens = [5, 70, 200, 33, 12, 99, 150, 7, 280, 3]
    got = backend.forward(tokens, backend.new_cache(), num_logits=len(tokens))
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0]
    scale = float(expected.abs().max())
    assert float((got - expected).abs().max()) < 2e-3 * scale  # llama.cpp keeps K/V in F16
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    target = load_backend(str(files["target"]), role="target", max_context=256, threads=1)
    check_vocab_compatible(target, backend)
    backend.close()


# -- CLI ------------------------------------------------------------------------------------------------------------

def test_cli_distils_end_to_end_and_the_result_loads_as_a_draft(files, tmp_path, capsys):
    out = tmp_path / "cli"
    args = ["distill", str(files["target"]), str(files["draft"]), "--prompts", str(files["prompts"]),
            "--holdout", "4", "--train-limit", "40", "--max-tokens", "16", "--eval-max-tokens", "12",
            "--method", "full", "--lr", "3e-3", "--batch-size", "8", "--gguf", "f16", "--threads", "1",
            "--max-context", "512", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "# specdec distill" in printed and "spec_k4" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["train_examples"] == 40 and report["evaluation"]["num_prompts"] == 4
    assert set(report["phase_seconds"]) >= {"load", "eval_before", "collect", "train", "export", "eval_after"}
    target = load_backend(str(files["target"]), role="target", max_context=256, threads=1)
    hf_draft = load_backend(str(out), role="draft", backend="torch", max_context=256)  # what --draft DIR loads
    check_vocab_compatible(target, hf_draft)
    check_vocab_compatible(target, load_backend(str(out / "draft.gguf"), role="draft", max_context=256, threads=1))
    # Reuse the collected data: no generation, no evaluation.
    again = tmp_path / "again"
    assert main(args[:-1] + [str(again), "--data", str(out / "distill-data.pt"), "--no-eval", "--gguf", "none"]) == 0
    assert (again / "model.safetensors").exists() and not (again / "draft.gguf").exists()


def test_cli_on_transformers_models_saves_the_hf_draft_and_says_why_no_gguf(tmp_path, capsys):
    tokenizer = tiny_tokenizer()
    target = save_tiny_model(tmp_path / "target", tiny_llama(0), tokenizer)
    draft = save_tiny_model(tmp_path / "draft", tiny_llama(1), tokenizer)
    prompts = tmp_path / "words.jsonl"
    rng = random.Random(0)
    prompts.write_text("".join(json.dumps(" ".join(f"w{rng.randint(4, 96)}" for _ in range(6))) + "\n"
                               for _ in range(12)))
    out = tmp_path / "out"
    assert main(["distill", target, draft, "--prompts", str(prompts), "--out", str(out), "--max-tokens", "6",
                 "--eval-max-tokens", "6", "--threads", "1", "--max-context", "128"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["gguf"] is None and "no GGUF to take the vocabulary from" in report["gguf_note"]
    assert report["evaluation"]["draft_after"] == str(out) and (out / "model.safetensors").exists()
    assert "GGUF: not written" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    ([], "exactly one of --prompts"),
    (["--prompts", "missing.jsonl"], "cannot read prompts file"),
    (["--prompts", "PROMPTS", "--task", "humaneval"], "exactly one of --prompts"),
    (["--prompts", "PROMPTS", "--holdout", "500"], "--holdout must be in"),
    (["--prompts", "BAD"], "not valid JSON"),
    (["--prompts", "PROMPTS", "--eval-methods", "hf_plain"], "our engine's methods only"),
    (["--prompts", "PROMPTS", "--epochs", "0"], "--epochs must be >= 1"),
])
def test_cli_errors_are_one_line_before_any_model_loads(files, tmp_path, capsys, extra, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    extra = [str(files["prompts"]) if e == "PROMPTS" else str(bad) if e == "BAD" else e for e in extra]
    code = main(["distill", "no-such-target.gguf", "no-such-draft.gguf", "--out", str(tmp_path / "o"), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err


def test_a_saved_draft_gets_the_umask_mode_not_0600(tmp_path):
    import os

    from specdec.distill.train import save_draft

    class Model:
        def save_pretrained(self, out):
            path = out / "model.safetensors"
            path.write_bytes(b"x")
            path.chmod(0o600)  # what safetensors' temporary file leaves

    old = os.umask(0o022)
    try:
        out = save_draft(Model(), tmp_path / "draft")
    finally:
        os.umask(old)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644
