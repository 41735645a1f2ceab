"""`specdec bench --fim`: the FIM bench's flags, their checks, and the run (docs/infill.md#the-bench)."""

from __future__ import annotations

import argparse
import sys

from specdec.bench.fim.problems import SETS, sample_problems
from specdec.bench.fim.report import summarise, to_markdown, write_fim_results
from specdec.bench.fim.run import DEFAULT_SYSTEMS, SYSTEMS, TraceOptions, run_fim_bench
from specdec.bench.serving.run import serving_environment
from specdec.bench.side_by_side import chosen, side_by_side_options
from specdec.cli.flags import parse_thread_list
from specdec.config import ConfigError


def add_fim_arguments(bench: argparse.ArgumentParser) -> None:
    group = bench.add_argument_group(
        "FIM bench (--fim)", "fill-in-the-middle through /infill on HumanEval infilling, ours beside llama-server; "
        "also uses --threads (one count), --max-context, --llamacpp-bin, --request-timeout, --out")
    group.add_argument("--fim", action="store_true",
                       help="run the FIM bench: a seeded sample of single- and multi-line HumanEval infilling "
                       "problems sent to every system's /infill, scored by their unit tests, and an editor trace")
    group.add_argument("--fim-sample", type=int, default=12, metavar="N", help="--fim: problems per set (default 12)")
    group.add_argument("--fim-sets", default="single,multi", help="--fim: sets, from: " + ", ".join(SETS))
    group.add_argument("--fim-seed", type=int, default=43, help="--fim: the sample's seed (default 43)")
    group.add_argument("--fim-systems", default=",".join(DEFAULT_SYSTEMS),
                       help="--fim: systems, from: " + ", ".join(SYSTEMS))
    group.add_argument("--fim-trace-files", type=int, default=4, metavar="N",
                       help="--fim: files in the editor trace (0: no trace; default 4)")


def run_fim_command(args: argparse.Namespace) -> int:
    counts = parse_thread_list(args.threads)
    if len(counts) > 1:
        raise ConfigError("--fim takes one --threads count (every server gets the same)")
    sets = chosen("--fim-sets", args.fim_sets, SETS)
    systems = tuple(chosen("--fim-systems", args.fim_systems, SYSTEMS))
    if args.fim_sample < 1:
        raise ConfigError(f"--fim-sample must be >= 1, got {args.fim_sample}")
    try:
        import httpx  # noqa: F401  (the bench extra, checked before any server starts)
    except ImportError as exc:
        raise ConfigError("the FIM bench needs httpx: pip install 'specdec[bench]'") from exc
    options, skipped = side_by_side_options(args, systems, counts[0])
    systems = options.systems
    problems = [p for s in sets for p in sample_problems(s, args.fim_sample, args.fim_seed)]
    trace = TraceOptions(files=args.fim_trace_files) if args.fim_trace_files > 0 else None
    print(f"FIM bench: {len(problems)} problems ({', '.join(sets)}; seed {args.fim_seed}), systems "
          f"{', '.join(systems)}, {options.threads} threads", file=sys.stderr, flush=True)
    results = run_fim_bench(problems, options, trace)
    results.update(environment=serving_environment(options), skipped_systems=skipped,
                   config={"sets": sets, "sample": args.fim_sample, "seed": args.fim_seed, "systems": list(systems),
                           "max_context": args.max_context, "threads": options.threads,
                           "trace": trace.__dict__ if trace else None})
    results["summary"] = summarise(results)
    paths = write_fim_results(results, args.out)
    print(to_markdown(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0
