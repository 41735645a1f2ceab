"""`specdec bench`: plain vs speculative vs transformers' assisted generation, one run, same weights, per task."""

from __future__ import annotations

import argparse
import sys

from ..cli_common import add_model_arguments, add_sampling_arguments, model_ref_from_args, sampling_from_args
from ..config import ConfigError
from .datasets import DEFAULT_TASKS, TASKS, load_tasks, parse_tasks
from .methods import DEFAULT_METHODS, FAMILIES, MethodOptions, parse_k_list, resolve_methods


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
        "--tasks", default=",".join(DEFAULT_TASKS),
        help=f"comma-separated tasks from: {', '.join(TASKS)} (default: {','.join(DEFAULT_TASKS)})",
    )
    bench.add_argument("--limit", type=int, default=None,
                       help="use the first N HumanEval problems per task (default: all 164)")
    bench.add_argument(
        "--methods", default=None,
        help=f"comma-separated methods from: {', '.join(FAMILIES)} (default: {','.join(DEFAULT_METHODS)}; "
        "'spec' and 'hf_assisted_k' expand to --k-sweep; plain, and hf_plain with transformers' speculative "
        "methods, are always added as baselines)",
    )
    bench.add_argument("--k-sweep", default="2,4,6",
                       help="draft lengths for the fixed-k methods (spec, hf_assisted_k); default 2,4,6")
    bench.add_argument("--num-speculative-tokens", "-k", "--draft-max", dest="k", type=int, default=5,
                       help="k for heuristic (start), prompt_lookup, hybrid and hf_prompt_lookup; default 5")
    bench.add_argument("--k-max", type=int, default=8, help="maximum k of the adaptive policy; default 8")
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
    from .gpu_cli import add_gpu_arguments

    add_gpu_arguments(bench)
    # HumanEval chat prompts stay under ~1k tokens; a smaller KV cache per engine keeps a 10-method run lean.
    bench.set_defaults(handler=run_bench_command, max_context=2048)
    for action in bench._actions:
        if action.dest == "max_context":
            action.help = "KV cache capacity in tokens (prompt + generated); default 2048 for bench"


def method_options(args: argparse.Namespace) -> MethodOptions:
    if not 1 <= args.k <= 64:
        raise ConfigError(f"-k must be in [1, 64], got {args.k}")
    if not 1 <= args.k_max <= 64:
        raise ConfigError(f"--k-max must be in [1, 64], got {args.k_max}")
    if not 0 <= args.draft_p_min < 1:
        raise ConfigError(f"--draft-p-min must be in [0, 1), got {args.draft_p_min}")
    return MethodOptions(k_sweep=parse_k_list(args.k_sweep), k=args.k, k_max=args.k_max,
                         draft_p_min=args.draft_p_min)


def validate_bench_args(args: argparse.Namespace) -> None:
    """Every cheap check, before minutes are spent loading models."""
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    parse_tasks(args.tasks)
    methods, _ = resolve_methods(args.methods, method_options(args))
    params = sampling_from_args(args)
    if params.stop and any(m.kind == "hf" for m in methods):
        raise ConfigError("--stop is not supported with the transformers methods; drop --stop or choose --methods")
    model_ref_from_args(args)


def run_bench_command(args: argparse.Namespace, decoder=None, log=None) -> int:
    """The `specdec bench` handler; `decoder` (an already loaded SpecDecoder) skips model loading."""
    from .gpu_cli import run_gpu_bench_command, wants_gpu_bench

    if decoder is None and wants_gpu_bench(args):
        return run_gpu_bench_command(args)
    from .datasets import DatasetError
    from .report import to_markdown, write_results
    from .runner import BenchConfig, run_bench

    try:
        validate_bench_args(args)
        prompts = load_tasks(parse_tasks(args.tasks), args.limit)
    except DatasetError as exc:
        raise ConfigError(str(exc)) from exc
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    ref = model_ref_from_args(args)
    loaded_here = decoder is None  # only then do the model references describe the decoder
    if decoder is None:
        from ..pipeline import SpecDecoder

        print(f"loading {ref.target} (draft: {ref.draft or 'none'}, backend {ref.backend})", file=sys.stderr, flush=True)
        decoder = SpecDecoder.load(ref)
    from .llamacpp_peer import PeerError, binaries_dir, gguf_files, missing_reason

    ggufs = gguf_files(decoder, ref.target, ref.draft) if loaded_here else gguf_files(decoder)
    methods, skipped = resolve_methods(
        args.methods, method_options(args), has_draft_model=decoder.draft is not None,
        has_hf_model=getattr(decoder.target, "model", None) is not None,
        llamacpp_missing=missing_reason(binaries_dir(args.llamacpp_bin), ggufs[0]),
        llamacpp_draft_missing=None if ggufs[1] is not None else "the draft is not a GGUF file",
    )
    on_torch = getattr(decoder.target, "model", None) is not None
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}", file=sys.stderr)
    config = BenchConfig(
        methods=methods, params=sampling_from_args(args), repeats=args.repeats, warmup=args.warmup, chat=args.chat,
        llamacpp_bin=args.llamacpp_bin, llamacpp_gguf=ggufs,
        extra={
            "target": ref.target, "draft": ref.draft,
            "weight_format": ref.weight_format if on_torch else "GGUF as stored (llama.cpp)",
            "draft_weight_format": (ref.draft_weight_format or ref.weight_format) if on_torch else None,
            "max_context": ref.max_context, "limit": args.limit, "k_sweep": list(parse_k_list(args.k_sweep)),
            "k": args.k, "k_max": args.k_max, "draft_p_min": args.draft_p_min, "argv": sys.argv[1:],
        },
    )
    print(f"benchmarking {len(methods)} methods on {len(prompts)} prompts "
          f"({', '.join(m.name for m in methods)})", file=sys.stderr, flush=True)
    try:
        results = run_bench(decoder, prompts, config, log=log)
    except PeerError as exc:  # llama-server failed to start or to answer: one line, not a traceback
        raise ConfigError(f"llama.cpp peer: {exc}") from exc
    results["skipped_methods"] = skipped
    paths = write_results(results, args.out, plot=args.plot)
    print(to_markdown(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


__all__ = ["register", "run_bench_command", "validate_bench_args"]
