"""`specdec bench --tools`: the tools bench's flags, their checks, and the run (docs/tools.md#the-bench)."""

from __future__ import annotations

import argparse
import sys

from specdec.bench.serving.run import serving_environment
from specdec.bench.side_by_side import chosen, side_by_side_options
from specdec.bench.tools.problems import SETS, sample_problems
from specdec.bench.tools.report import summarise, to_markdown, write_tools_results
from specdec.bench.tools.run import DEFAULT_SYSTEMS, SYSTEMS, run_tools_bench
from specdec.cli.flags import parse_thread_list
from specdec.config import ConfigError


def add_tools_arguments(bench: argparse.ArgumentParser) -> None:
    group = bench.add_argument_group(
        "tools bench (--tools)", "BFCL tool calling and structured output through /v1/chat/completions, ours beside "
        "llama-server --jinja; also uses --threads (one count), --max-context, --llamacpp-bin, --request-timeout, --out")
    group.add_argument("--tools", action="store_true",
                       help="run the tools bench: a seeded sample of BFCL simple, multiple and parallel problems "
                       "with their functions as tools, judged by BFCL's rules, and each sampled simple problem's "
                       "parameter schema as response_format")
    group.add_argument("--tools-sample", type=int, default=10, metavar="N", help="--tools: problems per set (default 10)")
    group.add_argument("--tools-sets", default="simple,multiple,parallel", help="--tools: sets, from: " + ", ".join(SETS))
    group.add_argument("--tools-structured", type=int, default=10, metavar="N",
                       help="--tools: simple problems asked as structured output (0: none; default 10)")
    group.add_argument("--tools-seed", type=int, default=45, help="--tools: the sample's seed (default 45)")
    group.add_argument("--tools-systems", default=",".join(DEFAULT_SYSTEMS),
                       help="--tools: systems, from: " + ", ".join(SYSTEMS))


def run_tools_command(args: argparse.Namespace) -> int:
    counts = parse_thread_list(args.threads)
    if len(counts) > 1:
        raise ConfigError("--tools takes one --threads count (every server gets the same)")
    sets = chosen("--tools-sets", args.tools_sets, SETS)
    systems = tuple(chosen("--tools-systems", args.tools_systems, SYSTEMS))
    if args.tools_sample < 1 or args.tools_structured < 0:
        raise ConfigError("--tools-sample must be >= 1 and --tools-structured >= 0")
    try:
        import httpx  # noqa: F401  (the bench extra, checked before any server starts)
        import jsonschema  # noqa: F401
    except ImportError as exc:
        raise ConfigError("the tools bench needs httpx and jsonschema: pip install 'specdec[bench]'") from exc
    options, skipped = side_by_side_options(args, systems, counts[0])
    systems = options.systems
    problems = [p for s in sets for p in sample_problems(s, args.tools_sample, args.tools_seed)]
    # Structured output from simple problems other than the sampled tool ones where the set allows.
    structured = sample_problems("simple", args.tools_sample + args.tools_structured, args.tools_seed + 1)
    taken = {p.id for p in problems}
    structured = [p for p in structured if p.id not in taken][:args.tools_structured]
    print(f"tools bench: {len(problems)} problems ({', '.join(sets)}; seed {args.tools_seed}) and {len(structured)} "
          f"structured, systems {', '.join(systems)}, {options.threads} threads", file=sys.stderr, flush=True)
    results = run_tools_bench(problems, structured, options)
    results.update(environment=serving_environment(options), skipped_systems=skipped,
                   config={"sets": sets, "sample": args.tools_sample, "structured": len(structured),
                           "seed": args.tools_seed, "systems": list(systems), "max_context": args.max_context,
                           "threads": options.threads})
    results["summary"] = summarise(results)
    paths = write_tools_results(results, args.out)
    print(to_markdown(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0
