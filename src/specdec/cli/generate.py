"""`specdec generate`: one prompt through the speculative decoder, compared with plain decoding, as text or JSON."""

from __future__ import annotations

import argparse
import json

from specdec.cli.flags import (
    add_model_arguments,
    add_sampling_arguments,
    add_spec_arguments,
    model_ref_from_args,
    sampling_from_args,
    spec_from_args,
    validate_early,
)
from specdec.cli.generation_report import GenerationInterrupted, format_generation_report, generation_report
from specdec.decoder import SpecDecoder
from specdec.errors import UserError

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."


def register(commands) -> None:
    """Add the `generate` subcommand to the `specdec` argparse subparsers."""
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
    gen.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
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
            print(json.dumps({"text": stop.text, "interrupted": True, "generated_tokens": stop.num_tokens,
                              "speculative_run_complete": stop.complete}, indent=2))
        elif not streaming:
            print(stop.text)
        raise
    if args.drafter is None:  # say why this drafter: the user did not choose it
        report["spec"]["why"] = ("the default with a draft model" if decoder.draft is not None
                                 else "the default without a draft model (model-free)")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        if not args.stream:
            print(report["text"])
        print()
        for entry in report.get("logprobs", ()):
            alternatives = ", ".join(f"{text!r} {p:.3f}" for _, text, p in entry["top"])
            print(f"  {entry['text']!r:>16} {entry['logprob']:8.4f}" + (f"   top: {alternatives}" if alternatives else ""))
        print(format_generation_report(report))
    return 0
