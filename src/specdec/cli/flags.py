"""Command-line flags shared by every subcommand (models, speculation, sampling) and their conversion to config."""

from __future__ import annotations

import argparse

from specdec.cli.run_config import argument_defaults, flagless_values, read_run_config
from specdec.config import (
    BACKENDS,
    WEIGHT_FORMATS,
    ConfigError,
    ModelRef,
    SamplingParams,
    SpecConfig,
    adaptive_max_k,
)
from specdec.loading.models import uses_cuda


def add_model_arguments(parser: argparse.ArgumentParser, draft: bool = True, config: bool = True) -> None:
    """The model flags; draft=False leaves out --draft, config=False leaves out --config (see add_config_argument)."""
    parser.add_argument(
        "model", nargs="?", default="default",
        help="target model: hub id (org/name[@rev]), local directory, .gguf file, or 'default' "
        "(Qwen2.5-Coder-1.5B-Instruct with the 0.5B as draft)",
    )
    if draft:
        parser.add_argument(
            "--draft", "-md", "--model-draft", dest="draft", default=None,
            help="draft model (same forms as the target); default: the default draft when the target is "
            "'default', else none (use --drafter for model-free drafting)",
        )
    parser.add_argument(
        "--backend", choices=BACKENDS, default="auto",
        help="runtime: llama.cpp (GGUF weights as stored, batch-invariant target), torch (transformers), or "
        "auto (default): llama.cpp for .gguf files and the default pair on CPU, torch otherwise",
    )
    parser.add_argument(
        "--threads", "-t", type=int, default=None,
        help="CPU threads for llama.cpp and torch (default: the CPUs this process may run on)",
    )
    parser.add_argument(
        "--exact", dest="batch_invariant", action="store_true", default=False,
        help="llama.cpp target: batch-invariant kernels, so greedy output is bit-identical to plain decoding "
        "(verification rows in slices of 1-3 rows on repacked weights, no flash attention; costs some speed). "
        "Default: llama.cpp's fastest kernels, lossless in distribution like every other engine; greedy output "
        "can then differ from plain decoding at near-ties, and `specdec generate` says where",
    )
    parser.add_argument("--no-batch-invariance", dest="batch_invariant", action="store_false",
                        help=argparse.SUPPRESS)  # the old spelling of today's default
    parser.add_argument(
        "--weight-format", "--dtype", dest="weight_format", choices=WEIGHT_FORMATS, default=None,
        help="torch backend: the number format the target's weights run in: fp32 (default on CPU, oneDNN-packed), "
        "bf16 (default on CUDA) or int8 (CPU only: fastest there, but its rounding can make greedy output differ "
        "from plain decoding at near-ties). The draft has its own --draft-weight-format. GGUF models on llama.cpp "
        "run the quantization stored in the file, so giving this flag selects torch under --backend auto",
    )
    parser.add_argument(
        "--draft-weight-format", dest="draft_weight_format", choices=WEIGHT_FORMATS + ("same",), default="int8",
        help="torch backend: weights for the draft model only (default int8; 'same' = as --weight-format). The "
        "draft's precision never changes the output, only how often drafts are accepted and how fast they are made",
    )
    parser.add_argument(
        "--device", default="auto",
        help="torch backend: auto (default: CUDA when present, else CPU), cpu, cuda or cuda:N. On CUDA the "
        "weights are bf16 unless --weight-format fp32, and passes run as captured CUDA graphs over a static KV cache",
    )
    parser.add_argument("--max-context", "--max-model-len", dest="max_context", type=int, default=4096,
                        help="KV cache capacity in tokens (prompt + generated); default 4096")
    if config:
        add_config_argument(parser)


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """--config FILE: a run-config file (what `specdec tune` writes) supplies defaults; flags given still win.

    argparse has no hook between parsing and the handler, so this parser's parse_known_args is wrapped:
    a first pass finds --config, the file's values become this parser's defaults for a second pass (only
    for destinations the parser has), and the defaults are restored. Position on the line does not matter.
    """
    parser.add_argument(
        "--config", metavar="FILE", default=None,
        help="read the model pair and speculation settings (and sampling, if present) from a JSON config file, "
        "e.g. the tuned.json `specdec tune` writes; flags given on the command line override it",
    )
    first_pass = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        parsed, rest = first_pass(args, None if namespace is None else argparse.Namespace(**vars(namespace)))
        if getattr(parsed, "config", None) is None:
            if namespace is None:
                return parsed, rest
            vars(namespace).update(vars(parsed))  # argparse fills a namespace it is given
            return namespace, rest

        try:
            run_config = read_run_config(parsed.config)
        except ConfigError as exc:  # one line, not argparse's usage block: the flags are not what is wrong
            parser.exit(2, f"{parser.prog}: error: {exc}\n")
        defaults = {dest: value for dest, value in argument_defaults(run_config).items() if hasattr(parsed, dest)}
        saved = {dest: parser.get_default(dest) for dest in defaults}
        parser.set_defaults(**defaults)
        try:
            parsed, rest = first_pass(args, namespace)
        finally:
            parser.set_defaults(**saved)
        if hasattr(parsed, "drafter"):  # generate and serve build a SpecConfig from the arguments
            for dest, value in flagless_values(run_config).items():
                setattr(parsed, dest, value)
        return parsed, rest

    parser.parse_known_args = parse_known_args


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-speculative-tokens", "-k", "--draft-max", dest="k", type=int, default=None,
                        help="draft tokens per step (the maximum, for the adaptive policy); default 5, and 16 for the "
                        "adaptive policy on CUDA, where a pass of 17 rows costs about one of 1 row")
    parser.add_argument("--drafter", default=None,
                        help="drafter: draft_model, prompt_lookup, suffix (a suffix trie over the prompt, the output and "
                        "recent outputs of other requests; draft length follows the match), hybrid (lookup first, draft "
                        "model otherwise) or none (plain decoding). Default: draft_model when a draft model is given "
                        "(--draft, or the default pair on CUDA), else suffix")
    parser.add_argument("--k-policy", choices=("fixed", "adaptive", "heuristic"), default="adaptive",
                        help="how k is chosen per step: adaptive (default: a cost model of measured acceptance and "
                        "timings, k from 0 up to -k; k = 0 when drafting does not pay on this machine), fixed, or "
                        "heuristic (transformers' +2/-1)")
    parser.add_argument("--draft-p-min", type=float, default=0.0,
                        help="stop drafting when the draft's top probability falls below this (default 0: off)")
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                        help="prefill every prompt from scratch (default: reuse the KV cache of the prefix a request "
                        "shares with the previous one, as llama-server does; never under --exact)")
    parser.add_argument("--no-suffix-cache", dest="suffix_cache", action="store_false",
                        help="suffix drafter: draft from this request's text only (default: also from a bounded, "
                        "in-memory cache of recent outputs, never written to disk)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", "-n", dest="max_tokens", type=int, default=128,
                        help="most tokens to generate per request (default 128; generation also ends at EOS or a stop "
                        "string)")
    parser.add_argument("--temperature", "--temp", dest="temperature", type=float, default=0.0,
                        help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="sample from the smallest set of tokens whose probabilities sum to P (default 1: off)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K",
                        help="sample from the K most probable tokens only (default 0: off)")
    parser.add_argument("--min-p", type=float, default=0.0, metavar="P",
                        help="drop tokens less probable than P times the most probable one (default 0: off)")
    parser.add_argument("--seed", type=int, default=None, metavar="N",
                        help="random seed of the sampler, for repeatable sampled output (default: none)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="keep generating past the end-of-sequence token, up to --max-tokens")
    parser.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                        help="OpenAI's presence penalty, in [-2, 2]: subtracted once from every token already "
                        "generated (default 0: off)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                        help="OpenAI's frequency penalty, in [-2, 2]: subtracted per time a token was generated "
                        "(default 0: off)")
    parser.add_argument("--repeat-penalty", "--repetition-penalty", dest="repetition_penalty", type=float,
                        default=1.0, metavar="R", help="llama.cpp's repetition penalty over the last --repeat-last-n "
                        "tokens of prompt and output (default 1: off)")
    parser.add_argument("--repeat-last-n", type=int, default=64, metavar="N",
                        help="tokens the repetition penalty looks back over (default 64; -1: all, 0: none)")
    parser.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help="report the target's log-probability of every generated token and of its N most "
                        "likely alternatives (0-20), read from the verify pass")
    parser.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                        help="add BIAS to token ID's logit (repeatable; -100 all but bans it)")


def parse_logit_bias(items: list[str]) -> dict[int, float]:
    """--logit-bias ID=BIAS items as a mapping; a malformed item is a ConfigError naming it."""
    out: dict[int, float] = {}
    for item in items:
        token, sep, bias = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(token)] = float(bias)
        except ValueError:
            raise ConfigError(f"--logit-bias takes ID=BIAS (an integer token id, a number), got {item!r}") from None
    return out


def model_ref_from_args(args: argparse.Namespace) -> ModelRef:
    target = "default-target" if args.model == "default" else args.model
    draft = getattr(args, "draft", None)
    drafter = getattr(args, "drafter", None)
    if draft is None and args.model == "default" and (drafter in ("draft_model", "hybrid")
                                                       or (drafter is None and default_pair_drafts_with_model(args))):
        draft = "default-draft"
    elif draft == "default":
        draft = "default-draft"
    draft_format = getattr(args, "draft_weight_format", "int8")
    backend = getattr(args, "backend", "auto")
    if args.weight_format is not None and backend == "llama.cpp":
        raise ConfigError("--weight-format applies to the torch backend; llama.cpp runs GGUF weights as stored")
    if args.weight_format is not None and backend == "auto":
        backend = "torch"  # a weight format is a torch conversion: asking for one asks for torch
    return ModelRef(
        target=target, draft=draft, weight_format=args.weight_format or default_weight_format(getattr(args, "device", "auto")),
        max_context=args.max_context,
        draft_weight_format=None if draft_format == "same" else draft_format, backend=backend,
        threads=getattr(args, "threads", None), batch_invariant=getattr(args, "batch_invariant", False),
        device=getattr(args, "device", "auto"),
    )


def default_weight_format(device: str) -> str:
    """bf16 on CUDA (what GPU checkpoints ship in), fp32 on the CPU (oneDNN-packed, exact per row)."""
    return "bf16" if uses_cuda(device) else "fp32"


def runs_on_cuda(args: argparse.Namespace) -> bool:
    """Whether the models run on CUDA: --device means CUDA and --backend is not llama.cpp (a CPU runtime here)."""
    return uses_cuda(str(getattr(args, "device", "auto"))) and getattr(args, "backend", "auto") != "llama.cpp"


def default_k(args: argparse.Namespace, drafter: str | None = None) -> int:
    """The largest draft when --k is not given: 5 for a fixed or heuristic k, config.adaptive_max_k for the adaptive policy."""
    if getattr(args, "k_policy", None) != "adaptive":
        return 5
    return adaptive_max_k(drafter or "draft_model", runs_on_cuda(args))


def default_pair_drafts_with_model(args: argparse.Namespace) -> bool:
    """Whether the default pair's 0.5B draft model is loaded when no --drafter is given: on CUDA only.

    On a CPU it cannot pay: it costs 0.4-0.6 of a 1.5B target step per token while each extra verified row
    costs 0.6-0.9 of one (docs/llamacpp.md, measured on AVX2 and AVX-512 EPYCs), so the adaptive policy
    would only ever spend time learning that; prompt lookup costs nothing when it finds no match.
    """
    return runs_on_cuda(args)


def spec_from_args(args: argparse.Namespace, has_draft_model: bool) -> SpecConfig:
    # No --drafter: the draft model when one is loaded, else the suffix drafter (model-free; with the adaptive
    # policy it drafts only where copying pays at the measured costs). Measured best of the model-free ones on
    # the 2-core CPU: benchmarks/suffix-2core.
    drafter = args.drafter or ("draft_model" if has_draft_model else "suffix")
    lookup = {name: getattr(args, name) for name in ("lookup_min_ngram", "lookup_max_ngram")
              if getattr(args, name, None) is not None}  # no flags: only a --config file sets them
    return SpecConfig(
        num_speculative_tokens=args.k if args.k is not None else default_k(args, drafter), drafter=drafter, draft_p_min=args.draft_p_min, k_policy=args.k_policy,
        prefix_cache=getattr(args, "prefix_cache", True), suffix_cache=getattr(args, "suffix_cache", True), **lookup,
    )


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        max_tokens=args.max_tokens, stop=tuple(args.stop), seed=args.seed, ignore_eos=args.ignore_eos,
        presence_penalty=getattr(args, "presence_penalty", 0.0), frequency_penalty=getattr(args, "frequency_penalty", 0.0),
        repetition_penalty=getattr(args, "repetition_penalty", 1.0), repeat_last_n=getattr(args, "repeat_last_n", 64),
        logit_bias=parse_logit_bias(getattr(args, "logit_bias", [])), logprobs=getattr(args, "logprobs", None),
    )


def validate_early(args: argparse.Namespace) -> None:
    """Check every cheap option before minutes are spent loading models."""
    sampling_from_args(args)
    spec_from_args(args, has_draft_model=True)
    model_ref_from_args(args)


def parse_thread_list(value) -> tuple[int | None, ...]:
    """--threads: None -> (None,) (the CPUs this process may use); 2 or "2" -> (2,); "1,2" -> (1, 2).

    A --config file can hold an int. Repeats are dropped: each count is one benchmark with its own report.
    """
    if value is None:
        return (None,)
    if isinstance(value, int) and not isinstance(value, bool):
        parts = [str(value)]
    elif isinstance(value, str):
        parts = [part.strip() for part in value.split(",")]
    else:
        raise ConfigError(f"--threads must be a positive integer or a comma list of them, got {value!r}")
    counts = []
    for part in parts:
        if not part.isdigit() or int(part) < 1:
            raise ConfigError(
                f"--threads must be a positive integer or a comma list of them (e.g. 1,2), got {value!r}")
        counts.append(int(part))
    return tuple(dict.fromkeys(counts))
