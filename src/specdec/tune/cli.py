"""`specdec tune TARGET --drafts D1,D2 [--drafters ...] [--prompts FILE.jsonl | --tasks ...]`: flags and the call."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from specdec.bench.datasets import DEFAULT_TASKS, TASKS, load_prompt_file, load_tasks, parse_tasks
from specdec.bench.method.methods import parse_k_list
from specdec.cli.flags import add_model_arguments, model_ref_from_args, runs_on_cuda
from specdec.config import ConfigError, SamplingParams
from specdec.loading.models import load_backend, load_pair
from specdec.tune.candidates import (
    DEFAULT_DRAFTERS,
    DEFAULT_K_POLICIES,
    DEFAULT_K_SWEEP,
    DRAFTERS,
    K_POLICIES,
    MIN_PAIRED_RUNS,
    TuneOptions,
    parse_drafts,
)
from specdec.tune.report import above_bound_text, ranked_table, write_outputs
from specdec.tune.run import tune


def register(commands) -> None:
    """Add the `tune` subcommand to the console script's subparsers."""
    p = commands.add_parser(
        "tune",
        help="choose the draft: measure candidate drafts, drafters and k policies on your prompts, write the winner",
        description=(
            "For every candidate draft model (hub id, directory, .gguf, 'default') and model-free drafter, measure "
            "on your prompts the acceptance per draft position, the cost ratio c and the real speedup over plain "
            "decoding (same target, same run, greedy) for each k policy, with a confidence interval from the "
            "interleaved paired runs; print a ranked table with the Leviathan bound beside each speedup, call a "
            "configuration faster or slower only when its interval says so, and write the winner (or 'do not "
            "speculate here', drafter none) as a config file for generate/serve/bench --config."
        ),
    )
    add_model_arguments(p, draft=False, config=False)
    p.add_argument("--drafts", default=None,
                   help="comma-separated candidate draft models (same forms as the target; 'default' = the packaged "
                   "0.5B draft). Default: 'default' for the default target, else none (model-free drafters only)")
    p.add_argument("--drafters", default=",".join(DEFAULT_DRAFTERS),
                   help=f"comma-separated drafters from {', '.join(DRAFTERS)} (default: all); draft_model and "
                   "hybrid run with every draft model, prompt_lookup and suffix once")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompts", default=None,
                        help="JSONL file of your prompts: one {\"prompt\": ...} (or \"text\"/\"instruction\") object "
                        "or string a line")
    source.add_argument("--tasks", "--task", dest="tasks", default=None,
                        help=f"bench tasks from {', '.join(TASKS)} (default without --prompts: {','.join(DEFAULT_TASKS)})")
    p.add_argument("--limit", type=int, default=None,
                   help="the first N prompts of --prompts, or the first N HumanEval problems per task")
    p.add_argument("--k-policies", default=",".join(DEFAULT_K_POLICIES),
                   help=f"k policies from {', '.join(K_POLICIES)} (default {','.join(DEFAULT_K_POLICIES)})")
    p.add_argument("--k-sweep", default=",".join(map(str, DEFAULT_K_SWEEP)),
                   help=f"draft lengths of the fixed policy (default {','.join(map(str, DEFAULT_K_SWEEP))})")
    p.add_argument("--k-max", type=int, default=None,
                   help="maximum k of the adaptive policy (default: what generate uses: 32 for the copying drafters; "
                        "for a draft model 5 on a CPU, 16 on CUDA)")
    p.add_argument("--heuristic-k", type=int, default=5, help="starting k of the heuristic policy (default 5)")
    p.add_argument("--draft-p-min", type=float, default=0.0,
                   help="stop drafting when the draft's top probability falls below this (default 0: off)")
    p.add_argument("--max-tokens", "-n", dest="max_tokens", type=int, default=128,
                   help="new tokens per prompt (default 128); decoding is greedy")
    p.add_argument("--min-speedup", type=float, default=1.03,
                   help="recommend a configuration only from this paired speedup on (default 1.03), and only when "
                   "its confidence interval lies above 1; otherwise tune says not to speculate and writes that")
    p.add_argument("--confidence", type=float, default=0.95,
                   help="confidence level of each speedup interval (default 0.95)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per prompt and configuration, interleaved with plain decoding (default: enough "
                   f"for {MIN_PAIRED_RUNS} paired runs per configuration, i.e. 1 from {MIN_PAIRED_RUNS} prompts on)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up runs")
    p.add_argument("--no-chat", dest="chat", action="store_false", default=None,
                   help="raw completion prompts instead of the tokenizer's chat template")
    p.add_argument("--out", "-o", default="tune-results",
                   help="output directory: tune.md, tune.json, tuned.json, the plots, runs/ (default tune-results/)")
    p.add_argument("--write-config", default=None, metavar="FILE",
                   help="where to write the winner's config file (default: OUT/tuned.json)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="do not draw the plots")
    # As for bench: short prompts, and one engine (with its KV cache) per configuration.
    p.set_defaults(handler=run_tune_command, max_context=2048)
    for action in p._actions:
        if action.dest == "max_context":
            action.help = "KV cache capacity in tokens (prompt + generated); default 2048 for tune"


def options_from_args(args: argparse.Namespace):
    for flag, value in (("--limit", args.limit), ("--repeats", args.repeats), ("--threads", args.threads)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    return TuneOptions(
        drafters=args.drafters, k_policies=args.k_policies, k_sweep=parse_k_list(args.k_sweep), k_max=args.k_max,
        heuristic_k=args.heuristic_k, draft_p_min=args.draft_p_min, min_speedup=args.min_speedup,
        confidence=args.confidence, on_cuda=runs_on_cuda(args),
    )


def prompts_from_args(args: argparse.Namespace):
    """The user's prompts (--prompts, first --limit) or the bench tasks' (--tasks, --limit problems each)."""
    if args.prompts is not None:
        return load_prompt_file(args.prompts)[: args.limit]
    return load_tasks(parse_tasks(args.tasks or ",".join(DEFAULT_TASKS)), args.limit)


def run_tune_command(args: argparse.Namespace, target=None, log=None) -> int:
    """The `specdec tune` handler; `target` (an already loaded backend) skips loading it."""
    options = options_from_args(args)
    params = SamplingParams(max_tokens=args.max_tokens)
    prompts = prompts_from_args(args)
    ref = replace(model_ref_from_args(args), draft=None)
    drafts = parse_drafts(args.drafts, args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    if target is None:
        print(f"tune: loading target {ref.target} (backend {ref.backend})", file=sys.stderr, flush=True)
        target, _ = load_pair(ref.target, None, ref.weight_format, ref.max_context, backend=ref.backend,
                              threads=ref.threads, batch_invariant=ref.batch_invariant)

    def load_draft(reference: str):
        return load_backend(reference, ref.draft_weight_format or ref.weight_format, ref.max_context, "draft",
                            ref.backend, ref.threads)

    result = tune(target, drafts, prompts, options, params, load_draft=load_draft, chat=args.chat,
                  repeats=args.repeats, warmup=args.warmup, log=log)
    result.info["argv"] = sys.argv[1:]
    paths = write_outputs(result, args.out, base_ref=ref, config_path=args.write_config, plot=args.plot)
    print(ranked_table(result))
    print()
    for line in summary_lines(result, paths.get("config")):
        print(line)
    for item in result.unusable:
        print(f"not usable with this target: {item['draft']}: {item['reason']}")
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


def summary_lines(result, config_path=None) -> list[str]:
    """The recommendation (or "do not speculate here") and the warnings, as printed under the table."""
    rec = result.recommendation
    lines = [f"recommendation: {rec.reason}"]
    if not rec.speculate and config_path:
        lines.append(f"wrote drafter none (plain decoding) to {config_path}")
    slower = [f"{row['candidate']} ({row['speedup']:.2f}x)" for row in result.rows if row["slower"]]
    if slower:
        lines.append(f"warning: slower than plain decoding, do not use: {'; '.join(slower)}")
    lines += [f"warning: {above_bound_text(row)}" for row in result.rows if row.get("above_bound") is not None]
    return lines


__all__ = ["options_from_args", "prompts_from_args", "register", "run_tune_command", "summary_lines"]
