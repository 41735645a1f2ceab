"""`specdec distill TARGET DRAFT --prompts FILE.jsonl | --task humaneval --out DIR`: flags, early checks, and the call."""

from __future__ import annotations

import argparse

import torch

from specdec.bench.datasets import TASKS
from specdec.config import BACKENDS, WEIGHT_FORMATS, ConfigError
from specdec.distill.data import DEFAULT_TOP_K, load_prompt_file, split_prompt_file, split_task
from specdec.distill.evaluate import DEFAULT_EVAL_METHODS, report_markdown
from specdec.distill.export_gguf import GGUF_TYPES
from specdec.distill.losses import LOSSES
from specdec.distill.run import DistillOptions, distill
from specdec.distill.train import DEFAULT_LR, DTYPES, METHODS, TrainConfig


def register(commands) -> None:
    """Add the `distill` subcommand to the console script's subparsers."""
    p = commands.add_parser(
        "distill",
        help="train the draft toward the target on your prompts (knowledge distillation) and report the gain",
        description=(
            "The target continues your training prompts (our engine, greedy by default) and its top-K token "
            "distributions are kept at every continuation position; the draft is trained (LoRA or full "
            "fine-tuning) to minimise a divergence to them. The distilled draft is saved in HF format to --out "
            "(load it with --draft DIR) and as DIR/draft.gguf for the llama.cpp backend; report.md and "
            "report.json give acceptance and speedup before vs after on held-out prompts."
        ),
    )
    p.add_argument("model", help="target model: hub id, local directory, .gguf file, or 'default'")
    p.add_argument("draft", help="draft model to train (same forms; 'default' = the packaged 0.5B draft)")
    source = p.add_argument_group("prompts (one of --prompts or --task)")
    source.add_argument("--prompts", default=None,
                        help="JSONL file: one {\"prompt\": ...} (or \"text\"/\"instruction\") object or string a line")
    source.add_argument("--heldout-prompts", default=None,
                        help="JSONL file of evaluation prompts (default: the last --holdout prompts of --prompts)")
    source.add_argument("--task", choices=sorted(TASKS), default=None,
                        help="train on a bench task's prompts (HumanEval problems) instead of a file")
    source.add_argument("--holdout", type=int, default=None,
                        help="prompts (or HumanEval problems) held out for the evaluation, never trained on "
                        "(default: 14 for --task, else a tenth of the file, at least 1)")
    source.add_argument("--eval-tasks", default=None,
                        help="with --task: tasks the held-out problems are evaluated on, e.g. humaneval,code_edit "
                        "(default: the --task)")
    source.add_argument("--train-limit", type=int, default=None, help="train on the first N training prompts only")
    p.add_argument("--out", "-o", required=True, help="output directory for the distilled draft and the report")

    data = p.add_argument_group("training data")
    data.add_argument("--max-tokens", "-n", dest="max_tokens", type=int, default=64,
                      help="tokens the target generates per training prompt (default 64)")
    data.add_argument("--temperature", "--temp", dest="temperature", type=float, default=0.0,
                      help="temperature of the target's continuations (default 0: greedy)")
    data.add_argument("--top-k", dest="top_k", type=int, default=DEFAULT_TOP_K,
                      help=f"target log-probs kept per position, renormalised over those ids (default {DEFAULT_TOP_K})")
    data.add_argument("--data", default=None, help="train on distill-data.pt saved by an earlier run (no generation)")

    train = p.add_argument_group("training")
    train.add_argument("--method", choices=METHODS, default="lora", help="lora (default, merged before saving) or full")
    train.add_argument("--loss", choices=LOSSES, default="fkl",
                       help="fkl: forward KL(target || draft) (default); tvd: total variation (1 - acceptance prob.)")
    train.add_argument("--epochs", type=int, default=1, help="passes over the training sequences (default 1)")
    train.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps (0: no training)")
    train.add_argument("--lr", type=float, default=None,
                       help=f"AdamW learning rate (default {DEFAULT_LR['lora']} for lora, {DEFAULT_LR['full']} for full)")
    train.add_argument("--batch-size", type=int, default=4, help="sequences per step (default 4)")
    train.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (default 16; alpha = 2 x rank)")
    train.add_argument("--train-dtype", choices=sorted(DTYPES), default="fp32", help="training precision (default fp32)")
    train.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu or cuda[:N]")
    train.add_argument("--seed", type=int, default=0, help="seed of the shuffling, LoRA init and sampling (default 0)")

    out = p.add_argument_group("export and evaluation")
    out.add_argument("--gguf", choices=("auto", "none", *GGUF_TYPES), default="auto",
                     help="write DIR/draft.gguf: auto (default: the source draft's own type, else f16, when a GGUF "
                     "vocabulary and llama.cpp are there), none, or a type")
    out.add_argument("--no-eval", dest="evaluate", action="store_false",
                     help="skip the before/after evaluation on the held-out prompts")
    out.add_argument("--eval-methods", default=DEFAULT_EVAL_METHODS,
                     help=f"bench methods for the evaluation, plain always added (default {DEFAULT_EVAL_METHODS})")
    out.add_argument("--eval-max-tokens", type=int, default=64, help="new tokens per held-out prompt (default 64)")
    out.add_argument("--no-chat", dest="chat", action="store_false", default=None,
                     help="raw completion prompts instead of the tokenizer's chat template")

    runtime = p.add_argument_group("runtime")
    runtime.add_argument("--backend", choices=BACKENDS, default="auto",
                         help="runtime of the target and of the draft in the evaluation (default auto)")
    runtime.add_argument("--threads", "-t", type=int, default=None, help="CPU threads for llama.cpp and torch")
    runtime.add_argument("--max-context", dest="max_context", type=int, default=4096,
                         help="KV cache capacity in tokens (default 4096)")
    runtime.add_argument("--draft-weight-format", choices=WEIGHT_FORMATS, default="int8",
                         help="a torch draft's weights in the evaluation (default int8)")
    p.set_defaults(handler=run_distill_command)


def options_from_args(args: argparse.Namespace):
    """DistillOptions from the flags (every check that needs no model)."""
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    train = TrainConfig(
        method=args.method, loss=args.loss, epochs=args.epochs, max_steps=args.max_steps, lr=args.lr,
        batch_size=args.batch_size, lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank, dtype=args.train_dtype,
        device=args.device, seed=args.seed,
    )
    return DistillOptions(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, train=train,
        evaluate=args.evaluate, eval_methods=args.eval_methods, eval_max_tokens=args.eval_max_tokens,
        gguf=None if args.gguf == "none" else args.gguf, chat=args.chat, backend=args.backend, threads=args.threads,
        max_context=args.max_context, draft_weight_format=args.draft_weight_format, data=args.data,
    )


def prompts_from_args(args: argparse.Namespace):
    """The train/held-out split the flags ask for; DatasetError (a ValueError) for bad files or numbers."""
    if (args.prompts is None) == (args.task is None):
        raise ConfigError("give the training prompts with exactly one of --prompts FILE.jsonl or --task NAME")
    if args.task is not None:
        if args.heldout_prompts:
            raise ConfigError("--heldout-prompts goes with --prompts; with --task use --holdout and --eval-tasks")
        split = split_task(args.task, 14 if args.holdout is None else args.holdout,
                           args.eval_tasks.split(",") if args.eval_tasks else None)
    else:
        if args.eval_tasks:
            raise ConfigError("--eval-tasks goes with --task")
        holdout = args.holdout
        if holdout is None and not args.heldout_prompts:
            holdout = max(1, len(load_prompt_file(args.prompts)) // 10)
        split = split_prompt_file(args.prompts, holdout or 0, args.heldout_prompts)
    if args.train_limit is not None:
        if args.train_limit < 1:
            raise ConfigError(f"--train-limit must be >= 1, got {args.train_limit}")
        split = type(split)(split.train[: args.train_limit], split.heldout)
    return split


def run_distill_command(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    split = prompts_from_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = distill(args.model, args.draft, split, args.out, options)

    print(report_markdown(report))
    return 0


__all__ = ["options_from_args", "prompts_from_args", "register", "run_distill_command"]
