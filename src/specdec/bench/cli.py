"""`specdec bench`: our methods beside transformers' and llama.cpp's, same weights, per task and threads."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys

import torch

from specdec.bench.datasets import DEFAULT_TASKS, SPEC_BENCH, TASKS, DatasetError, parse_tasks, select_prompts
from specdec.bench.fim.cli import add_fim_arguments, run_fim_command
from specdec.bench.gpu.cli import add_gpu_arguments, run_gpu_bench_command, wants_gpu_bench
from specdec.bench.llamacpp_peer import PeerError, binaries_dir, gguf_files, missing_reason
from specdec.bench.method.exact import exact_missing_reason
from specdec.bench.method.methods import (
    DEFAULT_METHODS,
    FAMILIES,
    MethodOptions,
    parse_k_list,
    resolve_methods,
)
from specdec.bench.method.render import (
    to_markdown,
    to_markdown_by_threads,
    write_results,
    write_results_by_threads,
)
from specdec.bench.method.runner import BenchConfig, run_bench
from specdec.bench.serving.cli import add_serving_arguments, run_serving_command
from specdec.bench.tools.cli import add_tools_arguments, run_tools_command
from specdec.cli.flags import (
    add_model_arguments,
    add_sampling_arguments,
    model_ref_from_args,
    parse_thread_list,
    runs_on_cuda,
    sampling_from_args,
)
from specdec.config import ConfigError, ModelRef
from specdec.decoder import SpecDecoder

METHOD_CONTEXT = 2048  # HumanEval chat prompts stay under ~1k tokens, Spec-Bench's first turns under ~1.7k
FIM_CONTEXT = 4096


def register(commands) -> None:
    """Add the `bench` subcommand to the console script's subparsers."""
    bench = commands.add_parser(
        "bench",
        help="benchmark plain, speculative and transformers-assisted decoding on HumanEval-based tasks",
        description=(
            "Run every method on the same loaded models, interleaved per prompt, and report tokens/s, speedup "
            "over plain decoding, acceptance (rate, mean length incl. bonus, per position), the measured cost "
            "ratio c, the Leviathan bound, and whether greedy outputs are identical to plain decoding. Writes "
            "results.json, results.md and bench.png to --out."
        ),
    )
    add_model_arguments(bench)
    add_sampling_arguments(bench)
    bench.add_argument(
        "--tasks", default=None,
        help=f"comma-separated tasks from: {', '.join(TASKS)} (default: {','.join(DEFAULT_TASKS)}, or "
        f"none when --prompts is given); {SPEC_BENCH} is 311 Spec-Bench chat questions, one task per "
        "category",
    )
    bench.add_argument(
        "--prompts", default=None, metavar="FILE.jsonl",
        help="prompts from a JSONL file, run after --tasks: Spec-Bench questions (question_id, category, "
        "turns: first turn, task = category), objects with \"prompt\" (and \"id\"), or JSON strings "
        "(task 'prompts')",
    )
    bench.add_argument("--limit", type=int, default=None,
                       help="the first N prompts of each task: N HumanEval problems per HumanEval task, N "
                       "questions per Spec-Bench category, N per task of --prompts (default: all)")
    bench.add_argument("--turns", type=int, default=1,
                       help="Spec-Bench turns per question (default 1; 2: each second turn runs right after its "
                       "first, on the conversation so far, with plain decoding's answer to the first turn; needs "
                       "the plain method)")
    bench.add_argument(
        "--methods", default=None,
        help=f"comma-separated methods from: {', '.join(FAMILIES)} (default: {','.join(DEFAULT_METHODS)}; "
        "'spec' and 'hf_assisted_k' expand to --k-sweep; exact_<one of ours> (exact_plain, exact_adaptive, "
        "...) runs it on a second llama.cpp target with the exact kernels of --exact, beside the default ones; "
        "plain, hf_plain with transformers' speculative methods and exact_plain with exact_ ones are always "
        "added as baselines)",
    )
    bench.add_argument("--k-sweep", default="2,4,6",
                       help="draft lengths for the fixed-k methods (spec, hf_assisted_k); default 2,4,6")
    bench.add_argument("--num-speculative-tokens", "-k", "--draft-max", dest="k", type=int, default=5,
                       help="k for heuristic (start), prompt_lookup, hybrid and hf_prompt_lookup; default 5")
    bench.add_argument("--k-max", type=int, default=None,
                       help="maximum k of the adaptive methods; default: what generate uses (32 for the copying "
                            "drafters; for a draft model 5 on a CPU, 16 on CUDA)")
    bench.add_argument("--draft-p-min", type=float, default=0.0,
                       help="stop drafting when the draft's top probability falls below this (default 0: off)")
    bench.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and method (default 1)")
    bench.add_argument("--no-warmup", dest="warmup", action="store_false",
                       help="skip the untimed warm-up run of each method")
    bench.add_argument("--no-chat", dest="chat", action="store_false", default=None,
                       help="raw completion prompts instead of the tokenizer's chat template")
    bench.add_argument("--llamacpp-bin", default=None,
                       help="folder holding llama.cpp's llama-server for the llamacpp_* peer methods (default: "
                       "$SPECDEC_LLAMACPP_BIN, else <specdec cache>/llama.cpp-<version>/bin)")
    bench.add_argument("--out", "-o", default="bench-results",
                       help="output directory for results.json, results.md, bench.png (default: bench-results/)")
    bench.add_argument("--no-plot", dest="plot", action="store_false", help="do not draw bench.png")

    add_gpu_arguments(bench)
    add_serving_arguments(bench)
    # A smaller KV cache per engine keeps a 10-method run lean (METHOD_CONTEXT). --fim: FIM_CONTEXT, so
    # llama-server's infill window (a 2048-token batch for prefix and suffix, the rest of the context less
    # 2 x n_predict for other files) keeps the same tokens on both servers.
    add_fim_arguments(bench)
    add_tools_arguments(bench)
    bench.set_defaults(handler=run_bench_command, max_context=None)
    for action in bench._actions:
        if action.dest == "max_context":
            action.help = ("KV cache capacity in tokens (prompt + generated); default 2048 for bench, "
                           f"{FIM_CONTEXT} for --fim and --tools")
        if action.dest == "threads":  # a list here: parse_thread_list reads it, with errors as ConfigError
            action.type = str
            action.metavar = "N[,N...]"
            action.help = ("CPU threads for llama.cpp, torch and the llama-server peers; a comma list (1,2) "
                           "runs the whole benchmark once per count, models loaded anew with it, one report "
                           "per count (default: the CPUs this process may run on)")


def method_options(args: argparse.Namespace) -> MethodOptions:
    if not 1 <= args.k <= 64:
        raise ConfigError(f"-k must be in [1, 64], got {args.k}")
    if args.k_max is not None and not 1 <= args.k_max <= 64:
        raise ConfigError(f"--k-max must be in [1, 64], got {args.k_max}")
    if not 0 <= args.draft_p_min < 1:
        raise ConfigError(f"--draft-p-min must be in [0, 1), got {args.draft_p_min}")

    return MethodOptions(k_sweep=parse_k_list(args.k_sweep), k=args.k, k_max=args.k_max,
                         draft_p_min=args.draft_p_min, on_cuda=runs_on_cuda(args))


def validate_bench_args(args: argparse.Namespace) -> None:
    """Every cheap check, before minutes are spent loading models."""
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    if not 1 <= getattr(args, "turns", 1) <= 8:
        raise ConfigError(f"--turns must be in [1, 8], got {args.turns}")
    parse_thread_list(args.threads)
    if args.tasks is not None:
        parse_tasks(args.tasks)
    methods, _ = resolve_methods(args.methods, method_options(args))
    params = sampling_from_args(args)
    if params.stop and any(m.kind == "hf" for m in methods):
        raise ConfigError("--stop is not supported with the transformers methods; drop --stop or choose --methods")
    ref = bench_model_ref(args)
    exact = [m.name for m in methods if m.exact]
    if exact and ref.batch_invariant:
        raise ConfigError(f"{', '.join(exact)}: --exact already puts every method on the exact kernels; drop "
                          "--exact to time the exact_ methods beside the default kernels")
    if exact and ref.backend == "torch":
        raise ConfigError(f"{', '.join(exact)}: the exact_ methods need the llama.cpp backend (the torch backend "
                          "has one set of kernels)")


def bench_model_ref(args: argparse.Namespace, threads: int | None = None) -> ModelRef:
    """The model references of the command line with `threads` (args.threads may be a list here)."""
    context = args.max_context if args.max_context is not None else METHOD_CONTEXT
    ref = model_ref_from_args(argparse.Namespace(**{**vars(args), "threads": None, "max_context": context}))
    if ref.draft is None and args.model == "default" and getattr(args, "draft", None) is None:
        # The default pair's draft model is loaded only when a method needs it (generate's rule would skip it).
        methods, _ = resolve_methods(args.methods, method_options(args))
        if any(m.needs_draft_model for m in methods):
            ref = dataclasses.replace(ref, draft="default-draft")
    return dataclasses.replace(ref, threads=threads)


def run_bench_command(args: argparse.Namespace, decoder=None, log=None) -> int:
    """The `specdec bench` handler; `decoder` (an already loaded SpecDecoder) skips model loading."""
    fim = getattr(args, "fim", False)
    tools = getattr(args, "tools", False)
    if args.max_context is None:
        args.max_context = FIM_CONTEXT if fim or tools else METHOD_CONTEXT
    if tools:
        if fim or decoder is not None or getattr(args, "serve", False):
            raise ConfigError("--tools starts its own servers: it takes no loaded decoder, no --serve and no --fim")
        return run_tools_command(args)
    if fim:
        if decoder is not None or getattr(args, "serve", False):
            raise ConfigError("--fim starts its own servers: it takes no loaded decoder and no --serve")
        return run_fim_command(args)
    if getattr(args, "serve", False):
        if decoder is not None:
            raise ConfigError("--serve starts its own servers; it takes no loaded decoder")

        return run_serving_command(args)
    thread_counts = parse_thread_list(args.threads)
    if decoder is None and wants_gpu_bench(args):
        if len(thread_counts) > 1:
            raise ConfigError("the GPU bench takes one --threads count")
        args.threads = thread_counts[0]
        return run_gpu_bench_command(args)

    try:
        validate_bench_args(args)
        prompts = select_prompts(args.tasks, getattr(args, "prompts", None), args.limit, getattr(args, "turns", 1))
    except DatasetError as exc:
        raise ConfigError(str(exc)) from exc
    if decoder is not None and len(thread_counts) > 1:
        raise ConfigError("several --threads counts need models loaded by the bench (one load per count), "
                          "not a given decoder")
    by_threads: dict = {}
    for threads in thread_counts:
        if len(thread_counts) > 1:
            print(f"== {threads} thread{'s' if threads != 1 else ''} ==", file=sys.stderr, flush=True)
        by_threads[threads] = _bench_at(args, prompts, threads, decoder, log)
    if len(by_threads) == 1:
        results = next(iter(by_threads.values()))
        paths = write_results(results, args.out, plot=args.plot)
        print(to_markdown(results))
    else:
        paths = write_results_by_threads(by_threads, args.out, plot=args.plot)
        print(to_markdown_by_threads(by_threads))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


def _bench_at(args: argparse.Namespace, prompts: list, threads: int | None, decoder=None, log=None) -> dict:
    """The whole method matrix at one thread count: models loaded with it (unless given), peers started
    with it."""
    if threads:
        torch.set_num_threads(threads)
    ref = bench_model_ref(args, threads)
    loaded_here = decoder is None  # only then do the model references describe the decoder
    if decoder is None:
        print(f"loading {ref.target} (draft: {ref.draft or 'none'}, backend {ref.backend}"
              f"{f', {threads} threads' if threads else ''})", file=sys.stderr, flush=True)
        decoder = SpecDecoder.load(ref)

    ggufs = gguf_files(decoder, ref.target, ref.draft) if loaded_here else gguf_files(decoder)
    methods, skipped = resolve_methods(
        args.methods, method_options(args), has_draft_model=decoder.draft is not None,
        has_hf_model=decoder.target.model is not None,
        llamacpp_missing=missing_reason(binaries_dir(args.llamacpp_bin), ggufs[0]),
        llamacpp_draft_missing=None if ggufs[1] is not None else "the draft is not a GGUF file",
        exact_missing=exact_missing_reason(decoder.target),
    )
    on_torch = decoder.target.model is not None
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}", file=sys.stderr)
    config = BenchConfig(
        methods=methods, params=sampling_from_args(args), repeats=args.repeats, warmup=args.warmup, chat=args.chat,
        llamacpp_bin=args.llamacpp_bin, llamacpp_gguf=ggufs, threads=threads,
        extra={
            "target": ref.target, "draft": ref.draft,
            "weight_format": ref.weight_format if on_torch else "GGUF as stored (llama.cpp)",
            "draft_weight_format": (ref.draft_weight_format or ref.weight_format) if on_torch else None,
            "max_context": ref.max_context, "limit": args.limit, "k_sweep": list(parse_k_list(args.k_sweep)),
            "k": args.k, "k_max": args.k_max, "draft_p_min": args.draft_p_min, "threads": threads,
            "prompts_file": getattr(args, "prompts", None), "argv": sys.argv[1:],
        },
    )
    print(f"benchmarking {len(methods)} methods on {len(prompts)} prompts "
          f"({', '.join(m.name for m in methods)})", file=sys.stderr, flush=True)
    try:
        results = run_bench(decoder, prompts, config, log=log)
    except PeerError as exc:  # llama-server failed to start or to answer: one line, not a traceback
        raise ConfigError(f"llama.cpp peer: {exc}") from exc
    finally:
        if loaded_here:
            # The next thread count loads the pair again: free this one first (peak RSS is one pair, not two).
            del decoder
            gc.collect()
    results["skipped_methods"] = skipped
    return results


__all__ = ["bench_model_ref", "parse_thread_list", "register", "run_bench_command", "validate_bench_args"]
