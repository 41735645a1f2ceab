"""`specdec bench --serve`: the serving bench's flags on the bench command, their checks, and the run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec.bench.datasets import DatasetError, select_prompts
from specdec.bench.llamacpp_peer import binaries_dir
from specdec.bench.serving.client import cpu_count
from specdec.bench.serving.report import to_markdown, write_serving_results
from specdec.bench.serving.run import (
    DEFAULT_CONCURRENCY,
    LLAMACPP_SYSTEMS,
    SYSTEMS,
    ServeOptions,
    parse_concurrency,
    parse_systems,
    run_serving_bench,
)
from specdec.cli.flags import parse_thread_list
from specdec.config import ConfigError
from specdec.loading.models import ModelLoadError, resolve


def add_serving_arguments(bench: argparse.ArgumentParser) -> None:
    group = bench.add_argument_group(
        "serving bench (--serve)",
        "our server and llama-server under concurrent streaming chat requests; also uses --tasks, --prompts, "
        "--limit, --threads (one count), --max-tokens, --max-context (per stream), --llamacpp-bin, --out")
    group.add_argument("--serve", action="store_true",
                       help="run the serving bench instead of the method bench: each system's server started "
                       "on its own at each concurrency, the prompts sent as streaming OpenAI chat requests; "
                       "writes results.json, results.md and serve.png (docs/serving-bench.md)")
    group.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, metavar="C[,C...]",
                       help=f"--serve: requests in flight per level, a comma list "
                       f"(default {DEFAULT_CONCURRENCY})")
    group.add_argument("--systems", default=None,
                       help=f"--serve: comma-separated systems from: {', '.join(SYSTEMS)} (default: all; the "
                       "reference, our server's plain decoding at concurrency 1, always runs)")
    group.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="--serve: longest a request may take, queueing included, before it counts as "
                       "failed (default 600)")


def check_serving_args(args: argparse.Namespace) -> None:
    """Refuse the method bench's flags that mean nothing here, before anything starts."""
    refused = [
        ("--methods", args.methods is not None, "choose --systems"),
        ("--turns", getattr(args, "turns", 1) != 1, "the serving bench sends first turns"),
        ("--repeats", args.repeats != 1, "each level runs once"),
        ("--exact", args.batch_invariant, "the exact server is the system ours_exact"),
        ("--no-chat", args.chat is False, "requests go to /v1/chat/completions"),
        ("--temperature", args.temperature != 0, "the serving bench is greedy"),
        ("--stop", bool(args.stop), "requests carry no stop strings"),
        ("--ignore-eos", args.ignore_eos, "requests stop at EOS"),
    ]
    for flag, given, why in refused:
        if given:
            raise ConfigError(f"{flag} does not apply to --serve: {why}")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not args.request_timeout > 0:
        raise ConfigError(f"--request-timeout must be positive, got {args.request_timeout:g}")
    parse_concurrency(args.concurrency)
    parse_systems(args.systems)


def our_model_args(args: argparse.Namespace) -> list[str]:
    """The model flags `specdec serve` gets: the bench's own, as given."""
    out = [args.model]
    if args.draft:
        out += ["--draft", args.draft]
    if args.backend != "auto":
        out += ["--backend", args.backend]
    if args.weight_format:
        out += ["--weight-format", args.weight_format]
    if str(args.device) != "auto":
        out += ["--device", str(args.device)]
    return out


def target_gguf(model: str) -> Path | None:
    """The target's GGUF file for llama-server (the packaged default's, assembled once), else None."""
    try:
        resolved = resolve("default-target" if model == "default" else model)
    except (ModelLoadError, OSError):
        return None
    return Path(resolved.source) / resolved.gguf_file if resolved.gguf_file else None


def run_serving_command(args: argparse.Namespace) -> int:
    check_serving_args(args)
    counts = parse_thread_list(args.threads)
    if len(counts) > 1:
        raise ConfigError("--serve takes one --threads count (every server gets the same)")
    try:
        import httpx  # noqa: F401  (the bench extra: checked before any server starts)
    except ImportError as exc:
        raise ConfigError("the serving bench needs httpx: pip install 'specdec[bench]'") from exc
    try:
        prompts = select_prompts(args.tasks, getattr(args, "prompts", None), args.limit)
    except DatasetError as exc:
        raise ConfigError(str(exc)) from exc
    systems = parse_systems(args.systems)
    wants_llama = any(s in LLAMACPP_SYSTEMS for s in systems)
    options = ServeOptions(
        model_args=our_model_args(args), threads=counts[0] or cpu_count(), max_context=args.max_context,
        max_tokens=args.max_tokens, concurrency=parse_concurrency(args.concurrency), systems=systems,
        target_gguf=target_gguf(args.model) if wants_llama else None,
        llamacpp_bin=binaries_dir(args.llamacpp_bin) if wants_llama else None,
        request_timeout=args.request_timeout,
        extra={"model": args.model, "draft": args.draft, "tasks": args.tasks, "limit": args.limit,
               "prompts_file": getattr(args, "prompts", None)},
    )
    print(f"serving bench: {len(prompts)} prompts, systems {', '.join(systems)}, concurrency "
          f"{', '.join(map(str, options.concurrency))}, {options.threads} threads",
          file=sys.stderr, flush=True)
    results = run_serving_bench(prompts, options)
    paths = write_serving_results(results, args.out, plot=args.plot)
    print(to_markdown(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


__all__ = [
    "add_serving_arguments", "check_serving_args", "our_model_args", "run_serving_command", "target_gguf",
]
