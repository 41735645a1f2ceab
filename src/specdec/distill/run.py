"""distill(): the whole DistillSpec-style run: evaluate the draft, collect the target's continuations, train the draft,
save it (HF directory and GGUF), evaluate it again on the same held-out prompts, and write the report."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gguf

from specdec.backends.llamacpp.backend import llama_cpp_module
from specdec.bench.method.runner import BenchConfig, BenchRunner
from specdec.config import ConfigError, SamplingParams
from specdec.decoder import SpecDecoder
from specdec.distill.data import DEFAULT_TOP_K, PromptSplit, collect_examples, load_examples, save_examples
from specdec.distill.evaluate import DEFAULT_EVAL_METHODS, compare, eval_methods, evaluate_draft, write_report
from specdec.distill.export_gguf import GGUF_TYPES, GGUFExportError, export_gguf
from specdec.distill.train import TrainConfig, load_trainable_draft, require_peft, save_draft, train_draft
from specdec.loading.models import check_vocab_compatible, load_backend

# general.file_type of a source GGUF -> the type its distilled replacement is written in ("auto").
_FILE_TYPES = {0: "f32", 1: "f16", 7: "q8_0", 15: "q4_k_m"}


@dataclass(frozen=True)
class DistillOptions:
    """Everything but the models and prompts. gguf: a type from GGUF_TYPES, "auto" (the source draft's own type,
    else f16; nothing without llama.cpp or a GGUF vocabulary) or None (no GGUF)."""

    max_tokens: int = 64  # length of the target's continuations (training data)
    temperature: float = 0.0  # 0: greedy continuations
    top_k: int = DEFAULT_TOP_K  # target log-probs kept per position
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: bool = True
    eval_methods: str = DEFAULT_EVAL_METHODS
    eval_max_tokens: int = 64
    gguf: str | None = "auto"
    chat: bool | None = None  # None: the tokenizer's chat template when it has one (as bench)
    backend: str = "auto"
    threads: int | None = None
    max_context: int = 4096
    draft_weight_format: str = "int8"  # a torch-backend draft's format in the evaluation
    data: str | None = None  # train on data saved by an earlier run instead of collecting it

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.eval_max_tokens < 1:
            raise ConfigError("--max-tokens and --eval-max-tokens must be >= 1")
        if self.top_k < 1:
            raise ConfigError(f"--top-k must be >= 1, got {self.top_k}")
        if self.gguf not in (None, "auto", *GGUF_TYPES):
            raise ConfigError(f"--gguf must be one of auto, none, {', '.join(GGUF_TYPES)}; got {self.gguf!r}")
        SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens)
        eval_methods(self.eval_methods)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def encode_prompts(decoder, prompts, chat: bool | None) -> list[tuple[str, list[int]]]:
    """Token ids of prompts exactly as `specdec bench` encodes them (chat template when there is one)."""
    runner = BenchRunner(decoder, BenchConfig(methods=[], chat=chat))
    try:
        return [(f"{p.task}/{p.id}", runner.encode(p)) for p in prompts]
    finally:
        runner.close()


def _gguf_kind(option: str | None, source_gguf: Path | None) -> str | None:
    if option != "auto":
        return option
    if source_gguf is None:
        return "f16"

    field_ = gguf.GGUFReader(str(source_gguf)).fields.get("general.file_type")
    return _FILE_TYPES.get(int(field_.contents()) if field_ is not None else 0, "f16")


def _load_draft_for_eval(path: str, options: DistillOptions, runtime: str):
    return load_backend(path, options.draft_weight_format, options.max_context, "draft", runtime, options.threads)


def distill(
    target: str,
    draft: str,
    prompts: PromptSplit,
    out_dir: str | Path,
    options: DistillOptions | None = None,
    log: Callable[[str], None] = _log,
    progress: bool = True,
) -> dict:
    """Distil `draft` toward `target` on prompts.train; save it to out_dir; report before vs after on prompts.heldout.

    Returns the report (also written to out_dir/report.json and report.md). out_dir receives the draft in HF
    format (config.json, weights, the target's tokenizer: their vocabularies are checked to be the same),
    draft.gguf when it can be written, distill-data.pt (the collected data), and eval-before/, eval-after/.
    """
    options = options or DistillOptions()
    require_peft(options.train)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    phases: dict[str, float] = {}
    began = time.perf_counter()
    target = "default-target" if target == "default" else target
    draft = "default-draft" if draft == "default" else draft

    log(f"loading {target} (target) and {draft} (draft)")
    target_backend = load_backend(target, "fp32", options.max_context, "target", options.backend, options.threads)
    draft_before = load_backend(draft, options.draft_weight_format, options.max_context, "draft", options.backend,
                                options.threads)
    check_vocab_compatible(target_backend, draft_before)
    draft_runtime = "llama.cpp" if draft_before.gguf_path is not None else "torch"
    phases["load"] = time.perf_counter() - began

    methods = eval_methods(options.eval_methods)
    eval_params = SamplingParams(max_tokens=options.eval_max_tokens)
    extra = {"target": target, "max_context": options.max_context}
    before = after = None
    if options.evaluate:
        log(f"evaluating the draft before training on {len(prompts.heldout)} held-out prompts")
        mark = time.perf_counter()
        before = evaluate_draft(target_backend, draft_before, prompts.heldout, methods, eval_params, options.chat,
                                {**extra, "draft": draft}, log=log)
        phases["eval_before"] = time.perf_counter() - mark
    draft_before.close()  # training loads its own copy; keep only one draft in memory
    del draft_before

    mark = time.perf_counter()
    params = SamplingParams(temperature=options.temperature, max_tokens=options.max_tokens, seed=options.train.seed)
    if options.data:
        examples, meta = load_examples(options.data)
        skipped: list[str] = list(meta.get("skipped", []))
        log(f"training on {len(examples)} sequences from {options.data}")
    else:
        train_ids = encode_prompts(SpecDecoder(target_backend), prompts.train, options.chat)
        log(f"collecting the target's continuations of {len(train_ids)} training prompts")
        examples, skipped = collect_examples(target_backend, train_ids, params, options.top_k, progress)
        save_examples(out / "distill-data.pt", examples, {"target": target, "top_k": options.top_k,
                                                          "max_tokens": options.max_tokens, "skipped": skipped})
    phases["collect"] = time.perf_counter() - mark
    if not examples:
        raise ConfigError("no training prompt fits the target's context; raise --max-context or lower --max-tokens")

    mark = time.perf_counter()
    model, source_gguf = load_trainable_draft(draft, options.train.dtype)
    model, result = train_draft(model, examples, options.train, progress)
    save_draft(model, out, target_backend.tokenizer)
    phases["train"] = time.perf_counter() - mark

    mark = time.perf_counter()
    gguf_path, gguf_note = _export(model, out, source_gguf, target_backend, options)
    if gguf_note:
        log(f"GGUF: {gguf_note}")
    del model
    phases["export"] = time.perf_counter() - mark

    draft_after_path = str(gguf_path) if gguf_path is not None and draft_runtime == "llama.cpp" else str(out)
    if options.evaluate:
        log(f"evaluating the distilled draft ({draft_after_path}) on the same held-out prompts")
        mark = time.perf_counter()
        draft_after = _load_draft_for_eval(draft_after_path, options,
                                           draft_runtime if draft_after_path.endswith(".gguf") else "torch")
        check_vocab_compatible(target_backend, draft_after)
        after = evaluate_draft(target_backend, draft_after, prompts.heldout, methods, eval_params, options.chat,
                               {**extra, "draft": draft_after_path}, log=log)
        phases["eval_after"] = time.perf_counter() - mark

    report = _report(target, draft, out, options, examples, skipped, result, gguf_path, gguf_note, prompts,
                     before, after, draft_after_path)
    report["phase_seconds"] = {k: round(v, 2) for k, v in phases.items()}
    report["phase_seconds"]["total"] = round(time.perf_counter() - began, 2)
    paths = write_report(report, out, before, after)
    log("wrote " + ", ".join(str(p) for p in paths.values()))
    return report


def _export(model, out: Path, source_gguf: Path | None, target_backend, options: DistillOptions):
    """Write out/draft.gguf when asked and possible; returns (path or None, a note saying why not)."""
    if options.gguf is None:
        return None, None
    vocab_gguf = target_backend.gguf_path
    kind = _gguf_kind(options.gguf, source_gguf)
    try:
        if options.gguf == "auto" and kind in ("q8_0", "q4_k_m"):
            llama_cpp_module()  # raises ImportError where llama-cpp-python is not installed
        return export_gguf(model, out / "draft.gguf", source_gguf, vocab_gguf, kind, options.threads or 0), None
    except (GGUFExportError, ImportError) as exc:
        if options.gguf != "auto":
            raise
        return None, f"not written ({exc})"


def _report(target, draft, out, options, examples, skipped, result, gguf_path, gguf_note, prompts: PromptSplit,
            before, after, draft_after_path) -> dict:
    train = {**asdict(options.train), "lr": options.train.learning_rate, **result.to_dict()}
    report = {
        "target": target, "draft": draft, "out_dir": str(out), "gguf": str(gguf_path) if gguf_path else None,
        "gguf_note": gguf_note,
        "data": {
            "source": _source(prompts.train), "train_examples": len(examples), "skipped_prompts": skipped,
            "train_positions": sum(len(e.continuation) for e in examples), "max_tokens": options.max_tokens,
            "decoding": "greedy" if options.temperature == 0 else f"sampled at T={options.temperature}",
            "top_k": options.top_k, "train_prompt_ids": [e.prompt_id for e in examples],
        },
        "training": train,
        "options": {k: v for k, v in asdict(options).items() if k != "train"},
    }
    if before is not None and after is not None:
        report["evaluation"] = {
            "num_prompts": before["config"]["num_prompts"], "tasks": before["summary"]["tasks"],
            "max_tokens": options.eval_max_tokens, "methods": [m["name"] for m in before["config"]["methods"]],
            "heldout_prompt_ids": [f"{p.task}/{p.id}" for p in prompts.heldout],
            "draft_before": draft, "draft_after": draft_after_path,
        }
        report["comparison"] = compare(before, after)
    return report


def _source(prompts: Sequence) -> str:
    tasks = list(dict.fromkeys(p.task for p in prompts))
    return ", ".join(tasks)


__all__ = ["DistillOptions", "distill", "encode_prompts"]
