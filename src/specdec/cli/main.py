"""The `specdec` console script: generate, serve and bench subcommands with clear errors instead of tracebacks."""

from __future__ import annotations

import argparse
import sys

from specdec.version import __version__
from specdec.cli.flags import (
    add_model_arguments,
    add_sampling_arguments,
    add_spec_arguments,
    model_ref_from_args,
    sampling_from_args,
    spec_from_args,
    validate_early,
)
from specdec.config import ConfigError

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."


class UserError(Exception):
    """An error caused by the user's input; printed as one line, exit code 2."""


def _expected_errors() -> tuple[type[BaseException], ...]:
    from specdec.backends.kvcache import ContextOverflowError
    from specdec.loading.models import ModelLoadError, VocabMismatchError

    return (ConfigError, ModelLoadError, VocabMismatchError, ContextOverflowError, UserError, ValueError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text speculatively and compare with plain decoding")
    add_model_arguments(gen)
    add_spec_arguments(gen)
    add_sampling_arguments(gen)
    gen.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="prompt text (default: a coding prompt)")
    gen.add_argument("--prompt-file", "-f", default=None, help="read the prompt from this file")
    gen.add_argument("--no-chat", dest="chat", action="store_false", default=None,
                     help="send the prompt raw instead of through the tokenizer's chat template")
    gen.add_argument("--no-compare", dest="compare", action="store_false",
                     help="skip the plain-decoding run (no speedup figure)")
    gen.add_argument("--repeats", type=int, default=3,
                     help="speculative and plain runs each for the speedup, interleaved in pairs, reported with a "
                     "95%% interval (default 3; 1: one pair, no interval)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    gen.add_argument("--json", action="store_true", help="print the result and statistics as JSON")
    gen.set_defaults(handler=_run_generate)

    for module, command, extra in OPTIONAL_COMMANDS:
        try:
            __import__(module, fromlist=["register"]).register(commands)
        except ImportError as exc:  # an extra is not installed: the command says which, instead of vanishing
            _register_missing(commands, command, extra, exc)
    return parser


# (module whose register() adds the subcommand, its name, the pip extra it needs)
OPTIONAL_COMMANDS = (
    ("specdec.server.cli", "serve", "server"),
    ("specdec.bench.cli", "bench", "bench"),
    ("specdec.distill.cli", "distill", "distill"),
    ("specdec.tune.cli", "tune", "bench"),
)


def _register_missing(commands, command: str, extra: str, exc: ImportError) -> None:
    missing = exc.name or str(exc)
    # No option prefix: whatever follows the command (flags included) is swallowed, so the refusal below is what
    # the user sees, not an argparse complaint about a flag the missing command would have known.
    stub = commands.add_parser(command, help=f"(needs: pip install 'specdec[{extra}]')", add_help=False,
                               prefix_chars="\0")
    stub.add_argument("ignored", nargs=argparse.REMAINDER)

    def refuse(_args: argparse.Namespace) -> int:
        raise UserError(f"'specdec {command}' needs the {extra} extra ({missing} is not installed): "
                        f"pip install 'specdec[{extra}]'")

    stub.set_defaults(handler=refuse)


def entry() -> int:
    """The `specdec` command: once, re-execute with glibc's malloc asking for huge pages (backends/hugepages.py:
    a 1.2x faster decoding step on the AMX Xeon, and a tunable is read only at process start), then main()."""
    import os

    from specdec.host.hugepages import environment_for_huge_pages

    environment = environment_for_huge_pages()
    if environment is not None and getattr(sys, "orig_argv", None):
        try:
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
        except OSError:
            pass  # run as we are
    return main()


def main(argv: list[str] | None = None) -> int:
    try:
        # Building the parser imports the subcommands (torch among them: seconds), so a Ctrl-C can land here.
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt as exc:
        print(f"specdec {args.command}: interrupted{_what_was_kept(exc)}", file=sys.stderr)
        return 130
    except _expected_errors() as exc:
        print(f"specdec {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2


def one_line(exc: BaseException) -> str:
    """An error message on one line: libraries' messages (transformers', huggingface_hub's) span several."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _what_was_kept(exc: KeyboardInterrupt) -> str:
    return getattr(exc, "note", "")  # report.GenerationInterrupted says what text it kept


def _run_generate(args: argparse.Namespace) -> int:
    from specdec.cli.generation_report import GenerationInterrupted, format_generation_report, generation_report

    validate_early(args)
    if not 1 <= args.repeats <= 100:
        raise UserError(f"--repeats must be in [1, 100], got {args.repeats}")
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as handle:
                args.prompt = handle.read()
        except OSError as exc:
            raise UserError(f"cannot read prompt file: {exc}") from exc
    ref = model_ref_from_args(args)
    from specdec.decoder import SpecDecoder

    decoder = SpecDecoder.load(ref)
    spec = spec_from_args(args, has_draft_model=decoder.draft is not None)
    plain_only = spec.drafter == "none"
    params = sampling_from_args(args)
    prompt_ids = decoder.encode(args.prompt, chat=args.chat)
    streaming = args.stream and not args.json
    # --drafter none (e.g. a tuned config that found no draft worth it): plain decoding, nothing to compare.
    try:
        report = generation_report(decoder, prompt_ids, params, spec, compare=args.compare and not plain_only,
                                   stream=streaming, repeats=args.repeats)
    except GenerationInterrupted as stop:
        # Ctrl-C keeps what was generated: streamed already, or printed now (main says how much, exit 130).
        if args.json:
            import json

            print(json.dumps({"text": stop.text, "interrupted": True, "generated_tokens": stop.num_tokens,
                              "speculative_run_complete": stop.complete}, indent=2))
        elif not streaming:
            print(stop.text)
        raise
    if args.drafter is None:  # say why this drafter: the user did not choose it
        report["spec"]["why"] = ("the default with a draft model" if decoder.draft is not None
                                 else "the default without a draft model (model-free)")
    if args.json:
        import json

        print(json.dumps(report, indent=2))
    else:
        if not args.stream:
            print(report["text"])
        print()
        print(format_generation_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(entry())
